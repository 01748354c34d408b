"""Incremental, fault-tolerant reading of metrics stream files.

A `StreamTail` remembers how far it has read; each `poll()` parses only the complete
IPC messages added since, so a live dashboard or the HTTP endpoint can follow a file
that a server is still appending to. A partial message at the end is left for the next
poll. Damage (bytes that are not a valid message, a batch that fails validation, an
unknown schema version) stops reading that file and is reported in `problem`; every
batch read before the damage is kept.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from hack_metrics import schema as S

EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


@dataclass
class StreamStatus:
    """What is known about one stream file after the latest poll."""

    path: Path
    rows: int = 0
    bytes_read: int = 0
    size: int = 0
    version: int | None = None
    closed: bool = False          # end-of-stream marker seen: the writer closed it
    problem: str | None = None    # damage or unknown version: reading stopped here
    partial_tail: int = 0         # bytes after the last complete message
    mtime: float = 0.0
    last_seq: int = 0
    label: str | None = None      # display name when the file is not local (HTTP)

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        return self.path.name[: -len(".arrows")] if self.path.name.endswith(".arrows") \
            else self.path.name

    def describe(self, stale_after_s: float = 30.0, now: float | None = None) -> str | None:
        """A sentence for the user when the stream is not a complete closed stream."""
        if self.problem:
            return f"{self.path.name}: {self.problem}"
        now = time.time() if now is None else now
        if self.size == 0:
            return f"{self.path.name}: empty file (the server has not written yet)"
        if self.closed:
            return None
        if self.partial_tail and now - self.mtime > stale_after_s:
            return (f"{self.path.name}: truncated or corrupted: the last {self.partial_tail} "
                    f"bytes are not a complete record batch (did the writer stop mid-write?); "
                    f"showing "
                    f"{self.rows} records read before it")
        if now - self.mtime > stale_after_s:
            return (f"{self.path.name}: not closed and not written for "
                    f"{now - self.mtime:.0f} s: the server may have stopped without "
                    f"closing it; the data may be partial")
        return None

    @property
    def live(self) -> bool:
        return not self.closed and self.problem is None


@dataclass
class StreamTail:
    """Follows one stream file; `poll()` returns the record batches added since last time."""

    path: Path
    status: StreamStatus = field(init=False)
    _schema: pa.Schema | None = field(default=None, init=False)
    _offset: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.status = StreamStatus(self.path)

    def poll(self) -> list[pa.RecordBatch]:
        st = self.status
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            st.problem = "file is missing"
            return []
        st.size, st.mtime = info.st_size, info.st_mtime
        if st.problem or st.closed:
            return []
        if info.st_size < self._offset:
            st.problem = (f"file shrank from {self._offset} to {info.st_size} bytes "
                          "while being read (overwritten?)")
            return []
        if info.st_size == self._offset:
            st.partial_tail = 0
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(info.st_size - self._offset)
        batches = self._parse(data)
        st.bytes_read = self._offset
        st.partial_tail = 0 if st.closed else info.st_size - self._offset
        return batches

    def _parse(self, data: bytes) -> list[pa.RecordBatch]:
        st = self.status
        reader = pa.BufferReader(data)
        out: list[pa.RecordBatch] = []
        base = self._offset
        while reader.tell() < len(data):
            start = reader.tell()
            if data[start:start + 8] == EOS:
                st.closed = True
                self._offset = base + start + 8
                break
            if len(data) - start < 8:
                break              # too short to hold a message header yet
            if data[start:start + 4] != EOS[:4]:
                st.problem = (f"corrupted at byte {base + start}: no IPC message marker; "
                              f"showing {st.rows} records read before it")
                break
            try:
                message = pa.ipc.read_message(reader)
            except EOFError:       # end-of-stream marker in the legacy 4-byte form
                st.closed = True
                self._offset = base + len(data)
                break
            except OSError:        # not enough bytes yet: a batch still being written
                break
            except Exception as exc:
                st.problem = (f"corrupted at byte {base + start}: {exc}; showing "
                              f"{st.rows} records read before it")
                break
            try:
                if self._schema is None:
                    self._accept_schema(message, base + start)
                else:
                    batch = pa.ipc.read_record_batch(message, self._schema)
                    batch.validate(full=True)
                    batch = S.conform(batch)  # an older version's stream: its missing columns as nulls
                    out.append(batch)
                    st.rows += batch.num_rows
                    if batch.num_rows:
                        st.last_seq = int(batch.column("seq")[-1].as_py())
            except S.SchemaVersionError as exc:
                st.problem = str(exc)
                break
            except Exception as exc:
                st.problem = (f"corrupted record batch at byte {base + start}: {exc}; "
                              f"showing {st.rows} records read before it")
                break
            self._offset = base + reader.tell()
        return out

    def _accept_schema(self, message: pa.ipc.Message, pos: int) -> None:
        if message.type != "schema":
            raise ValueError(f"expected a schema message at byte {pos}, found {message.type}")
        schema = pa.ipc.read_schema(message)
        self.status.version = S.check_schema(schema, self.path.name)
        self._schema = schema

    @property
    def schema(self) -> pa.Schema | None:
        return self._schema


def read_stream(path: str | os.PathLike) -> tuple[pa.Table, StreamStatus]:
    """Read a whole stream file once; damage is reported in the status, never raised."""
    tail = StreamTail(Path(path))
    try:
        batches = tail.poll()
    except Exception as exc:  # an unreadable file must not take the caller down
        tail.status.problem = f"unreadable: {exc}"
        batches = []
    return to_table(batches), tail.status


def to_table(batches: list[pa.RecordBatch]) -> pa.Table:
    """Concatenate batches; an empty list gives an empty table of the current schema."""
    if not batches:
        return S.arrow_schema().empty_table()
    return pa.Table.from_batches(batches)
