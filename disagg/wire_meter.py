"""Bytes on the wire per request, counted where the transfer engine is called.

Every successful call of SGLang's MooncakeTransferEngine.batch_transfer_sync/transfer_sync adds
its lengths to a per-thread tally. A request's transfer ends with its metadata row
(MooncakeKVManager.send_aux, which knows the bootstrap room); at that point the tally of the
sending thread is attributed to that room: one JSON line in `$HACK_DISAGG_WIRE_LOG` (if set)
and a `transfer` span in the metrics stream (engine.metrics, keyed by the room). SGLang sends
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


def finish_room(room: int) -> dict:
    """Attribute this thread's tally to `room` and reset it.

    `busy_s` is the time spent inside the (synchronous) transfer calls, i.e. on the wire;
    `t_start`..`t_last` spans the first to the last call, which with chunked prefill also
    covers the prefill compute of later chunks that the transfers overlap."""
    t = _tally()
    rec = {"room": int(room), "bytes": t["bytes"], "calls": t["calls"], "busy_s": t["busy"],
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
                t_ns=int(end * 1e9))
    except Exception:  # noqa: BLE001 - metrics must never break a transfer
        logger.debug("metrics span for room %s not recorded", room, exc_info=True)
    return rec


def around_send_aux(original: Callable, manager: Any, req: Any, *a: Any, **kw: Any) -> Any:
    ret = original(manager, req, *a, **kw)
    finish_room(getattr(req, "room", -1))
    return ret


def read_log(path: str | os.PathLike) -> list[dict]:
    """The records of a wire log (missing file = none)."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
