"""Per-request timeline and memory metrics of a HACK server.

Calling it (from the SGLang hooks, or any process of a server)::

    from engine import metrics as hm

    hm.configure(run_dir, role="prefill", instance="0", prometheus=True)  # once per process
    hm.event("arrival", rid, room=room, tokens=prompt_len)
    hm.start("queue", rid, room=room)      ...  hm.end("queue", rid, room=room)
    hm.start("prefill", rid, room=room)    ...  hm.end("prefill", rid, room=room)
    hm.span("quantization", rid, dur_s, room=room, method="attributed",
            note="share of the store kernel")           # fused phase: its duration only
    hm.start("transfer", rid, room=room)   ...  hm.end("transfer", rid, room=room,
                                                       bytes=n_wire, bytes_bf16=n_bf16)
    hm.event("first_token", rid, room=room)
    hm.step(rid, dur_s, room=room)          # one decode step (or one summary span:)
    hm.span("decode", rid, dur_s, room=room, tokens=n_out, method="derived")
    hm.event("finish", rid, room=room, tokens=n_out)
    hm.event("error", rid, room=room, note="transfer timed out")
    hm.sample(pages_used=.., pages_total=.., bytes_codes=.., bytes_side=.., bytes_tail=..,
              bytes_bf16=.., running=.., queued=..)    # rss_bytes is filled in
    hm.start_sampler(lambda: {...sample fields...}, interval_s=1.0)

Every function takes an optional `t_ns` (wall clock, `time.time_ns()`) for records
written after the fact, e.g. an arrival time read from SGLang's request time stats.
Phases: queue, prefill, quantization, transfer, approximation, dequantization, decode
(`schema.PHASES`); roles: prefill, decode, colocated, router.

Without `configure()`, the first record configures from the environment:
HACK_METRICS_RUN_DIR (required, else every call is a cheap no-op), HACK_METRICS_ROLE
(default colocated), HACK_METRICS_INSTANCE (default 0), HACK_METRICS_PROMETHEUS=1.

Each process writes its own append-only Arrow IPC stream `<role>-<instance>.arrows` in
the run directory (`<role>-<instance>.<n>.arrows` if that name is taken, e.g. after a
restart or from a second process of the same server). Calls never raise: errors are
logged and counted (`get_sink().errors`, `.dropped`).

This package is the writer side, inside the servers: the sink (the stream writer), `http_api`
(the live routes SGLang serves: `GET /hack/events?since=<seq>`), `prometheus` (`hack:` metrics)
and `synthetic` (clearly labelled made-up runs, written through the sink). Reading is the
`hack_metrics` package (no SGLang): `hack_metrics.runload.RunLoader(run_dir).load()` ->
`hack_metrics.run_view.build_view(data)` gives joined requests, spans, the exclusive breakdown.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable

from engine.metrics.sink import MetricsSink

log = logging.getLogger("hack.metrics")

_sink: MetricsSink | None = None
_env_checked = False
_lock = threading.Lock()


def configure(run_dir: str | os.PathLike, role: str = "colocated", instance: str = "0", *,
              prometheus: bool = False, flush_every: int = 256, flush_ms: float = 200.0,
              strict: bool = False) -> MetricsSink:
    """Open this process's sink (closing a previous one). Raises ValueError on bad args."""
    global _sink, _env_checked
    export = None
    if prometheus:
        from engine.metrics.prometheus import default_export
        export = default_export()
    sink = MetricsSink(Path(run_dir), role, instance, flush_every=flush_every,
                       flush_ms=flush_ms, prometheus=export, strict=strict)
    with _lock:
        old, _sink, _env_checked = _sink, sink, True
    if old is not None:
        old.close()
    return sink


def _from_env() -> MetricsSink | None:
    global _env_checked
    with _lock:
        if _env_checked:
            return _sink
        _env_checked = True
    run_dir = os.environ.get("HACK_METRICS_RUN_DIR")
    if not run_dir:
        return None
    try:
        return configure(run_dir, os.environ.get("HACK_METRICS_ROLE", "colocated"),
                         os.environ.get("HACK_METRICS_INSTANCE", "0"),
                         prometheus=os.environ.get("HACK_METRICS_PROMETHEUS") == "1")
    except Exception as exc:
        log.warning("hack metrics disabled: bad HACK_METRICS_* environment: %s", exc)
        return None


def get_sink() -> MetricsSink | None:
    """The sink of this process, or None when metrics are off."""
    return _sink if _env_checked else _from_env()


def enabled() -> bool:
    return get_sink() is not None


def record(kind: str, rid: Any = None, **fields: Any) -> None:
    """Low-level: one record of any kind with schema columns as keyword arguments."""
    sink = _sink if _env_checked else _from_env()
    if sink is not None:
        sink.record(kind, rid, **fields)


def event(kind: str, rid: Any, **fields: Any) -> None:
    """A point event: arrival, first_token, finish, error."""
    record(kind, rid, **fields)


def start(phase: str, rid: Any, **fields: Any) -> None:
    record("start", rid, phase=phase, **fields)


def end(phase: str, rid: Any, **fields: Any) -> None:
    record("end", rid, phase=phase, **fields)


def span(phase: str, rid: Any, dur_s: float, **fields: Any) -> None:
    """A phase known by its duration, ending now (or at `t_ns`)."""
    record("span", rid, phase=phase, dur_ns=int(dur_s * 1e9), **fields)


def step(rid: Any, dur_s: float, tokens: int = 1, **fields: Any) -> None:
    """One decode step of one request."""
    record("step", rid, phase="decode", dur_ns=int(dur_s * 1e9), tokens=tokens, **fields)


def process_rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def sample(**fields: Any) -> None:
    """A periodic server sample; `rss_bytes` defaults to this process's RSS."""
    if get_sink() is None:
        return
    fields.setdefault("rss_bytes", process_rss())
    record("sample", None, **fields)


def start_sampler(fn: Callable[[], dict], interval_s: float = 1.0) -> threading.Event:
    """Call `fn()` every `interval_s` in a daemon thread and record its dict as a sample.
    Set the returned event to stop it. Exceptions from `fn` are logged, not raised."""
    stop = threading.Event()

    def loop() -> None:
        failures = 0
        while not stop.wait(interval_s):
            try:
                sample(**(fn() or {}))
            except Exception as exc:
                failures += 1
                if failures <= 3:
                    log.warning("hack metrics sampler failed: %s", exc)

    threading.Thread(target=loop, name="hack-metrics-sampler", daemon=True).start()
    return stop


def flush() -> None:
    if _sink is not None:
        _sink.flush()


def close() -> None:
    """Flush and close this process's stream (writes the end-of-stream marker)."""
    global _sink
    with _lock:
        sink, _sink = _sink, None
    if sink is not None:
        sink.close()
