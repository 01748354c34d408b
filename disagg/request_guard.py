"""Refuse, at the HTTP layer, a request that a disaggregated server cannot route.

A prefill or decode server needs the bootstrap fields the router adds (bootstrap_host,
bootstrap_room; bootstrap_port has a default). Without them SGLang's decode scheduler dies
on the request (an AttributeError deep in its networking code). Raising ValueError in the
tokenizer manager's validation makes SGLang answer 400 with this message instead.

`input_embeds` on a decode server: SGLang refuses it on a server whose radix cache is on, and a
decode server always runs without one, so the router's decode leg was accepted while the
prefill refused its leg, and the decode waited for KV that never came: the client got no
answer (through the Rust router) until the PD waiting timeout. A decode server now refuses it
too unless it was launched with `--disable-radix-cache` (as the prefill then must be: `hack up`
gives both servers the same flags).

Parallel sampling (`n` > 1) on a prefill or decode server: SGLang 0.5.23 first sends a warm-up
copy of the request (no new token) and then n copies, all under the one bootstrap room the router
gave the request, so the two sides never pair their transfers and the request hangs (through the
Rust router the client got no answer until it gave up; found by `hack bench fuzz --targets router`).
Both servers refuse it with a 400 naming `n`, so the router answers at once.
"""
from __future__ import annotations

from typing import Any


def _missing(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, list):
        return any(v is None or v == "" for v in value) or not value
    return value == ""


# Whether this server's command line asked for --disable-radix-cache (SGLang turns it on for every
# decode server itself, so the parsed ServerArgs cannot tell); set once at startup.
_radix_asked_off = False


def note_radix_cache_flag(disable_radix_cache: bool) -> None:
    global _radix_asked_off
    _radix_asked_off = bool(disable_radix_cache)


def _pd_mode(manager: Any) -> str:
    """The tokenizer manager's disaggregation mode: "prefill", "decode" or "null" (colocated)."""
    return getattr(getattr(manager, "disaggregation_mode", None), "value", "null")


def check_input_embeds(manager: Any, obj: Any, radix_asked_off: bool | None = None) -> None:
    """ValueError for `input_embeds` on a decode server launched with its radix cache on."""
    if _pd_mode(manager) != "decode" or getattr(obj, "input_embeds", None) is None:
        return
    if _radix_asked_off if radix_asked_off is None else radix_asked_off:
        return
    raise ValueError("input_embeds through prefill/decode disaggregation needs --disable-radix-cache on the "
                     "prefill and decode servers: a prefill with its radix cache on refuses it, and this decode "
                     "server would wait for KV that never comes")


def check_parallel_sampling(manager: Any, obj: Any) -> None:
    """ValueError for `n` > 1 on a prefill or decode server (see the module docstring)."""
    if _pd_mode(manager) not in ("prefill", "decode"):
        return
    sp = getattr(obj, "sampling_params", None)
    ns = [p.get("n") for p in (sp if isinstance(sp, list) else [sp]) if isinstance(p, dict)]
    ns.append(getattr(obj, "parallel_sample_num", None))
    if any(isinstance(n, int) and not isinstance(n, bool) and n > 1 for n in ns):
        raise ValueError("n > 1 (parallel sampling) is not supported through prefill/decode disaggregation: "
                         "SGLang sends the samples under one bootstrap room and the transfer never pairs; send "
                         "n separate requests")


def check_bootstrap_fields(manager: Any, obj: Any) -> None:
    mode = _pd_mode(manager)
    if mode not in ("prefill", "decode"):
        return
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    host = getattr(obj, "bootstrap_host", None)
    if host == FAKE_BOOTSTRAP_HOST or (isinstance(host, list) and host and
                                       all(h == FAKE_BOOTSTRAP_HOST for h in host)):
        return  # SGLang's own health probe: it fills the room itself
    missing = [name for name in ("bootstrap_host", "bootstrap_room")
               if _missing(getattr(obj, name, None))]
    if missing:
        raise ValueError(
            f"this is a {mode} server of a disaggregated pair: a request needs "
            f"{' and '.join(missing)} (send it through the router, e.g. the URL `hack up` prints)")
