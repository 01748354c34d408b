"""Append-only Arrow IPC stream writer, safe to call from SGLang's scheduler loop.

`record()` only validates a small dict and appends it to a list under a lock; a daemon
thread turns the buffer into one Arrow record batch every `flush_every` records or
`flush_ms` milliseconds and appends it to the stream file with a single write (so a
reader never sees half a batch except while that write is in flight). Errors inside the
sink are logged and counted, never raised into the server (unless `strict=True`, which
tests use to catch bad records).
"""
from __future__ import annotations

import atexit
import io
import logging
import os
import re
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pyarrow as pa

from hack_metrics import schema as S

log = logging.getLogger("hack.metrics")

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")


def stream_path(run_dir: Path, server: str, attempt: int) -> Path:
    """`<server>.arrows` for the first stream of a server, `<server>.<n>.arrows` after."""
    return run_dir / (f"{server}.arrows" if attempt == 0 else f"{server}.{attempt}.arrows")


class MetricsSink:
    """Buffers records and appends them as Arrow record batches to one stream file."""

    def __init__(self, run_dir: str | os.PathLike, role: str, instance: str = "0", *,
                 flush_every: int = 256, flush_ms: float = 200.0,
                 max_buffer: int = 200_000, prometheus: Any = None,
                 strict: bool = False) -> None:
        if role not in S.ROLES:
            raise ValueError(f"role must be one of {S.ROLES}, got {role!r}")
        if not _NAME_RE.match(str(instance)):
            raise ValueError(f"instance must match {_NAME_RE.pattern}, got {instance!r}")
        self.run_dir = Path(run_dir)
        self.role = role
        self.server = f"{role}-{instance}"
        self.flush_every = max(1, int(flush_every))
        self.flush_s = max(0.001, float(flush_ms) / 1000.0)
        self.max_buffer = int(max_buffer)
        self.strict = strict
        self.prometheus = prometheus
        self.path: Path | None = None
        self.written = 0   # records on disk
        self.dropped = 0   # records lost (buffer full, invalid, write errors)
        self.errors = 0
        self._schema = S.arrow_schema()
        self._buf: list[dict] = []
        self._seq = 0
        self._lock = threading.Lock()       # guards _buf and _seq
        self._io_lock = threading.Lock()    # serializes flushes
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._mem: io.BytesIO | None = None
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._pid = os.getpid()
        atexit.register(self.close)
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _reset_in_child(ref))

    # ---- hot path -------------------------------------------------------------------
    def record(self, kind: str, rid: str | None = None, **fields: Any) -> None:
        """Queue one record. Fields are the schema's columns (phase, room, t_ns, ...)."""
        try:
            if self._closed:
                return
            row = {"kind": kind, "rid": None if rid is None else str(rid),
                   "role": self.role, "server": self.server,
                   "schema_version": S.SCHEMA_VERSION}
            row.update(fields)
            if row.get("t_ns") is None:
                row["t_ns"] = time.time_ns()
            unknown = set(row) - set(S.COLUMNS)
            if unknown:
                raise ValueError(f"unknown metrics fields {sorted(unknown)}")
            S.validate_record(row)
            with self._lock:
                if len(self._buf) >= self.max_buffer:
                    self.dropped += 1
                    return
                self._seq += 1
                row["seq"] = self._seq
                self._buf.append(row)
                full = len(self._buf) >= self.flush_every
            if self._thread is None:
                self._start_thread()
            if full:
                self._wake.set()
        except Exception as exc:  # never break the caller
            self.dropped += 1
            if self.strict:
                raise
            self._log_error("dropped a metrics record", exc)

    # ---- flushing -------------------------------------------------------------------
    def _start_thread(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="hack-metrics-flush",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        """Write everything buffered as one record batch (no-op when empty)."""
        with self._io_lock:
            with self._lock:
                rows, self._buf = self._buf, []
            if not rows:
                return
            try:
                batch = pa.RecordBatch.from_pylist(rows, schema=self._schema)
                self._append(batch)
                self.written += len(rows)
            except Exception as exc:
                self.dropped += len(rows)
                self._log_error(f"lost {len(rows)} metrics records", exc)
                return
            if self.prometheus is not None:
                try:
                    self.prometheus.observe_rows(rows)
                except Exception as exc:
                    self._log_error("prometheus export failed", exc)

    def _open(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(1000):
            path = stream_path(self.run_dir, self.server, attempt)
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND,
                                   0o644)
            except FileExistsError:
                continue  # a restart or a second process of this server: next name
            self.path = path
            break
        else:
            raise RuntimeError(f"no free stream file name for {self.server} in {self.run_dir}")
        self._mem = io.BytesIO()
        self._writer = pa.ipc.new_stream(self._mem, self._schema)
        self._write_pending()

    def _write_pending(self) -> None:
        data = self._mem.getvalue()
        self._mem.seek(0)
        self._mem.truncate()
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def _append(self, batch: pa.RecordBatch) -> None:
        if self._fd is None:
            self._open()
        self._writer.write_batch(batch)
        self._write_pending()

    def close(self) -> None:
        """Flush, write the end-of-stream marker and close the file (idempotent)."""
        if self._closed or os.getpid() != self._pid:
            return
        self.flush()
        self._closed = True
        self._wake.set()
        with self._io_lock:
            try:
                if self._writer is not None:
                    self._writer.close()
                    self._write_pending()
            except Exception as exc:
                self._log_error("closing the metrics stream failed", exc)
            finally:
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None

    @property
    def closed(self) -> bool:
        return self._closed

    def _after_fork(self) -> None:
        """In a forked child: drop the parent's buffer, thread and file, start afresh.
        The child's records go to a stream file of its own (the next free name)."""
        self._lock, self._io_lock = threading.Lock(), threading.Lock()
        self._wake = threading.Event()
        self._thread = None
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = self._writer = self._mem = self.path = None
        self._buf, self._seq = [], 0
        self.written = self.dropped = self.errors = 0
        self._pid = os.getpid()

    def _log_error(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        # The first few errors in full, then one line per thousand: a broken disk must
        # not turn into a log flood inside the scheduler.
        if self.errors <= 3 or self.errors % 1000 == 0:
            log.warning("hack metrics (%s): %s: %s (errors so far: %d)",
                        self.server, what, exc, self.errors)


def _reset_in_child(ref: "weakref.ref[MetricsSink]") -> None:
    sink = ref()
    if sink is not None and not sink.closed:
        sink._after_fork()
