"""Per-request timeline and memory samples of a server, recorded with engine.metrics.

Hooked into SGLang's scheduler (engine.hooks): a request's arrival opens its queue phase; the
first batch that runs it closes the queue and opens prefill (at the batch's launch time); the
batch that finishes its last prompt chunk closes prefill and marks the first token; every
decode batch then records one step per request; a finished request records `finish` (with
its finish reason when it was aborted). The fused phases the CPU path times inside each
forward (quantization, approximation, dequantization: engine.fused_phases) are summed per
request and recorded as attributed spans when its prefill ends and when it finishes. On the
PD decode side the first decode batch closes the queue (SGLang handles the prebuilt batch
outside process_batch_result), and a request that finishes in its prebuilt batch (its only
token came from prefill) is closed there (`on_prebuilt`). On the PD prefill side each arrival
notes its prompt for the wire meter's BF16-equivalent bytes (engine.usage.transfers). A sampler
thread records the KV pool's memory once a second (engine.usage.memory_sample).
Everything is a no-op unless metrics are configured (HACK_METRICS_RUN_DIR, see
docs/dashboard.md): the cost is then one check per scheduler call.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from engine import metrics as hm

from . import fused_phases, usage

_MAX_TRACKED = 20000  # requests aborted while queued never reach a batch: bound the table
_state: "OrderedDict[str, dict]" = OrderedDict()
_sampler: list = []


def _room(obj: Any) -> int | None:
    room = getattr(obj, "bootstrap_room", None)
    return room if isinstance(room, int) else None


def _wall_ns_of_monotonic(ts: float | None) -> int:
    now = time.time_ns()
    if ts is None:
        return now
    return now - int((time.monotonic() - ts) * 1e9)


def _is_pd_prefill(scheduler: Any) -> bool:
    return getattr(getattr(scheduler, "disaggregation_mode", None), "value", None) == "prefill"


def on_arrival(scheduler: Any, recv_req: Any) -> None:
    room = _room(recv_req)
    ids = getattr(recv_req, "input_ids", None)
    if room is not None and ids is not None and _is_pd_prefill(scheduler):
        # The wire meter takes it when the transfer ends (BF16-equivalent bytes on the wire).
        usage.transfers.note(room, len(ids), scheduler.token_to_kv_pool_allocator.get_kvcache())
    if not hm.enabled():
        return
    rid = recv_req.rid
    hm.event("arrival", rid, room=room, tokens=len(ids) if ids is not None else None)
    hm.start("queue", rid, room=room)
    _state[rid] = {"room": room, "phase": "queue", "last_ns": None}
    while len(_state) > _MAX_TRACKED:
        _state.popitem(last=False)
    if not _sampler:
        _sampler.append(hm.start_sampler(lambda: usage.memory_sample(scheduler), interval_s=1.0))


def on_batch_result(scheduler: Any, batch: Any) -> None:
    if not hm.enabled():
        return
    mode = batch.forward_mode
    now = time.time_ns()
    launch_ns = _wall_ns_of_monotonic(getattr(batch, "launch_ts", None))
    rec = fused_phases.take([req.rid for req in batch.reqs]) if batch.reqs else None
    fused = rec.shares() if rec is not None else {}
    for req in batch.reqs:
        st = _state.get(req.rid)
        if st is None:
            continue
        room = st["room"]
        acc = st.setdefault("fused", {})
        for phase, sec in fused.get(req.rid, {}).items():
            acc[phase] = acc.get(phase, 0.0) + sec
        if st["phase"] == "queue" and (mode.is_extend() or mode.is_prebuilt()):
            hm.end("queue", req.rid, room=room, t_ns=launch_ns)
            if mode.is_prebuilt():  # PD decode side: the prompt was prefilled elsewhere
                st.update(phase="decode", last_ns=now, first=True)
            else:
                hm.start("prefill", req.rid, room=room, t_ns=launch_ns)
                st["phase"] = "prefill"
        elif st["phase"] == "queue" and mode.is_decode():
            # PD decode: SGLang processes the prebuilt batch (the first token, made by prefill)
            # outside process_batch_result, so the first decode batch is where we see it.
            hm.end("queue", req.rid, room=room, t_ns=launch_ns)
            hm.event("first_token", req.rid, room=room, t_ns=launch_ns)
            st.update(phase="decode", last_ns=launch_ns)
        if st["phase"] == "prefill" and mode.is_extend() and not getattr(req, "inflight_middle_chunks", 0):
            if len(getattr(req, "output_ids", ()) or ()) > 0 or req.finished():
                _emit_fused(req.rid, st, now)
                hm.end("prefill", req.rid, room=room, t_ns=now, **_prompt_sources(req))
                hm.event("first_token", req.rid, room=room, t_ns=now)
                st.update(phase="decode", last_ns=now)
        elif st["phase"] == "decode" and (mode.is_decode() or mode.is_extend()) and st["last_ns"] is not None \
                and now > st["last_ns"]:
            if st.pop("first", False):
                hm.event("first_token", req.rid, room=room, t_ns=now)
            hm.step(req.rid, (now - st["last_ns"]) / 1e9, room=room, t_ns=now)
            st["last_ns"] = now
        if req.finished():
            _finish(req, st, now)


def _prompt_sources(req: Any) -> dict:
    """The prompt tokens a request did not compute, and of those the ones an external store (the
    page tier) restored: SGLang's own counts on the request (what its meta_info reports)."""
    cached = getattr(req, "cached_tokens", None)
    if not isinstance(cached, int):
        return {}
    restored = sum(int(getattr(req, f, 0) or 0) for f in ("cached_tokens_host", "cached_tokens_storage"))
    return {"cached_tokens": cached, "restored_tokens": restored}


def on_prebuilt(batch: Any) -> None:
    """PD decode: SGLang turns the transferred requests into a prebuilt batch outside
    process_batch_result. A request whose only token is the one prefill made (EOS first, or
    max_new_tokens=1) finishes there and never reaches a decode batch: close it here.
    The others are left to their first decode batch (on_batch_result)."""
    if not hm.enabled():
        return
    now = time.time_ns()
    for req in batch.reqs:
        st = _state.get(req.rid)
        if st is None or not req.finished():
            continue
        if st["phase"] == "queue":
            hm.end("queue", req.rid, room=st["room"], t_ns=now)
        if st["phase"] == "queue" or st.get("first"):  # its first token was not recorded yet
            hm.event("first_token", req.rid, room=st["room"], t_ns=now)
        _finish(req, st, now)


def _finish(req: Any, st: dict, now: int) -> None:
    _emit_fused(req.rid, st, now)
    reason = getattr(req.finished_reason, "to_json", lambda: {})()
    kind = reason.get("type") if isinstance(reason, dict) else None
    note = None if kind in (None, "stop", "length") else str(reason)[:200]
    hm.event("finish", req.rid, room=st["room"], tokens=len(req.output_ids), note=note, t_ns=now)
    _state.pop(req.rid, None)


_FUSED_NOTES = {
    "quantization": "host clock around the K/V store of every layer (page quantization, FP16 "
                    "tails, sinks), split among the batch by new tokens; summed since the last record",
    "approximation": "host clock around decode attention on the codes (INT8 Q/P, integer matmuls and "
                     "the Eq. 4 approximation fused in one call: an upper bound of the approximation), "
                     "split among the batch by context length; summed over the decode steps",
    "dequantization": "host clock around building the dense BF16 copy of the pages (SDPA excluded), "
                      "split among the batch by context length; summed over the decode steps",
}


def _emit_fused(rid: str, st: dict, now: int) -> None:
    """One span per fused phase accumulated since the last emission. They are sums over many
    forward passes, so they are drawn back to back ending now (never overlapping each other,
    so the exclusive breakdown keeps every one of them whole)."""
    end = now
    for phase, sec in sorted(st.pop("fused", {}).items()):
        if sec > 0:
            hm.span(phase, rid, sec, room=st["room"], method="attributed", note=_FUSED_NOTES.get(phase),
                    t_ns=end)
            end -= int(sec * 1e9)
