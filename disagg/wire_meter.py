"""Bytes on the wire per request, counted where the transfer engine is called.

Every successful call of SGLang's MooncakeTransferEngine.batch_transfer_sync/transfer_sync adds
its lengths to a per-thread tally. A request's transfer ends with its metadata row
(MooncakeKVManager.send_aux, which knows the bootstrap room); at that point the tally of the
sending thread is attributed to that room. That one record (`finish_room`) is the single
source of the request's wire numbers: it is written as one JSON line in `$HACK_DISAGG_WIRE_LOG`
(if set; read by `hack bench disagg`) and as a `transfer` span in the metrics stream
(engine.metrics, keyed by the room; read by the dashboard), with the same fields. Next to the
bytes sent it carries `tokens` (the prompt tokens sent: the prompt less the prefix the decode
server already held) and `bytes_bf16`, what those tokens' K and V take in a BF16 cache of this
model (engine.usage: layers x KV heads x head_dim of the server's pool, noted when the request
arrived); both are None when the prompt was not noted (metrics of another process). SGLang sends
all chunks of one room from the same transfer worker thread, so with one request in flight per
thread the attribution is exact; with several interleaved requests the total stays exact and
the split between them is approximate.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)

WIRE_LOG_ENV = "HACK_DISAGG_WIRE_LOG"

_local = threading.local()
_file_lock = threading.Lock()
_totals = {"bytes": 0, "requests": 0}


def _tally() -> dict:
    t = getattr(_local, "tally", None)
    if t is None:
        t = _local.tally = {"bytes": 0, "calls": 0, "t0": None, "t_last": None, "busy": 0.0}
    return t


def add(nbytes: int, started: float, ended: float | None = None) -> None:
    """Count `nbytes` moved by a call that ran from `started` to `ended` (wall clock)."""
    ended = time.time() if ended is None else ended
    t = _tally()
    if t["t0"] is None:
        t["t0"] = started
    t["t_last"] = ended
    t["busy"] += max(0.0, ended - started)
    t["bytes"] += int(nbytes)
    t["calls"] += 1


def around_batch_transfer(original: Callable, engine: Any, target: str, buffers: Sequence[int],
                          peer_addresses: Sequence[int], lengths: Sequence[int], *a: Any, **kw: Any) -> int:
    started = time.time()
    ret = original(engine, target, buffers, peer_addresses, lengths, *a, **kw)
    if ret == 0:
        add(sum(int(x) for x in lengths), started)
    return ret


def around_transfer(original: Callable, engine: Any, target: str, buffer: int, peer: int,
                    length: int, *a: Any, **kw: Any) -> int:
    started = time.time()
    ret = original(engine, target, buffer, peer, length, *a, **kw)
    if ret == 0:
        add(int(length), started)
    return ret


def finish_room(room: int, decode_prefix_len: int | None = None) -> dict:
    """Attribute this thread's tally to `room` and reset it.

    `busy_s` is the time spent inside the (synchronous) transfer calls, i.e. on the wire;
    `t_start`..`t_last` spans the first to the last call, which with chunked prefill also
    covers the prefill compute of later chunks that the transfers overlap.
    `decode_prefix_len`: prompt tokens the decode server already held (not sent)."""
    from engine import usage

    t = _tally()
    sent = usage.transfers.take(room, decode_prefix_len or 0)
    rec = {"room": int(room), "bytes": t["bytes"], "calls": t["calls"], "busy_s": t["busy"],
           "tokens": sent[0] if sent else None, "bytes_bf16": sent[1] if sent else None,
           "t_start": t["t0"], "t_last": t["t_last"], "t_end": time.time(), "pid": os.getpid()}
    _local.tally = None
    _totals["bytes"] += rec["bytes"]
    _totals["requests"] += 1
    path = os.environ.get(WIRE_LOG_ENV)
    if path:
        try:
            with _file_lock, open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as exc:
            logger.warning("cannot append to %s: %s", path, exc)
    try:
        from engine import metrics as hm

        # The span ends with the last transfer call and lasts the time spent on the wire.
        end = rec["t_last"] or rec["t_end"]
        hm.span("transfer", None, rec["busy_s"], room=int(room), bytes=rec["bytes"],
                bytes_bf16=rec["bytes_bf16"], tokens=rec["tokens"], t_ns=int(end * 1e9))
    except Exception:  # noqa: BLE001 - metrics must never break a transfer
        logger.debug("metrics span for room %s not recorded", room, exc_info=True)
    return rec


def around_send_aux(original: Callable, manager: Any, req: Any, *a: Any, **kw: Any) -> Any:
    ret = original(manager, req, *a, **kw)
    finish_room(getattr(req, "room", -1), getattr(req, "decode_prefix_len", None))
    return ret


def read_log(path: str | os.PathLike) -> list[dict]:
    """The records of a wire log (missing file = none)."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
