"""Refuse, at the HTTP layer, a request that a disaggregated server cannot route.

A prefill or decode server needs the bootstrap fields the router adds (bootstrap_host,
bootstrap_room; bootstrap_port has a default). Without them SGLang's decode scheduler dies
on the request (an AttributeError deep in its networking code). Raising ValueError in the
tokenizer manager's validation makes SGLang answer 400 with this message instead.
"""
from __future__ import annotations

from typing import Any


def _missing(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, list):
        return any(v is None or v == "" for v in value) or not value
    return value == ""


def check_bootstrap_fields(manager: Any, obj: Any) -> None:
    mode = getattr(getattr(manager, "disaggregation_mode", None), "value", "null")
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
