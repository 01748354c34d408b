"""Load a run directory (once, or incrementally while it grows) into DataFrames.

Everything that is wrong with the data becomes a sentence in `RunData.warnings` (missing
directory, missing run.json, no streams, a server of run.json without a stream, damaged
or truncated streams, unknown schema versions, unpaired phase records); nothing raises.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow as pa

from hack_metrics import rundir
from hack_metrics.reader import StreamStatus, StreamTail
from hack_metrics.schema import COLUMNS, SUPPORTED_VERSIONS, arrow_schema

# A stream not written for this long, and not closed, is reported as possibly stale.
STALE_AFTER_S = 30.0


@dataclass
class RunData:
    """Raw records of one run plus what the user must be told about them."""

    source: str
    meta: dict = field(default_factory=dict)
    records: pd.DataFrame = field(default_factory=lambda: empty_frame())
    streams: list[StreamStatus] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    live: bool = False

    @property
    def has_data(self) -> bool:
        return len(self.records) > 0


def empty_frame() -> pd.DataFrame:
    return arrow_schema().empty_table().to_pandas()


def table_to_frame(table: pa.Table) -> pd.DataFrame:
    """Arrow -> pandas with nullable integers kept exact (no float conversion)."""
    return table.to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get)


class RunLoader:
    """Follows a run directory: new stream files are picked up, old ones read onward."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self._tails: dict[Path, StreamTail] = {}
        self._batches: dict[Path, list[pa.RecordBatch]] = {}
        self._lock = threading.Lock()
        self._frame: pd.DataFrame | None = None

    def load(self) -> RunData:
        with self._lock:
            return self._load()

    def _load(self) -> RunData:
        data = RunData(source=str(self.run_dir))
        if not self.run_dir.is_dir():
            data.warnings.append(f"run directory {self.run_dir} does not exist")
            return data
        try:
            data.meta = rundir.read_run(self.run_dir)
        except (FileNotFoundError, ValueError) as exc:
            data.warnings.append(f"run.json: {exc}; label, servers and link rate unknown")
        changed = False
        for path in rundir.stream_files(self.run_dir):
            tail = self._tails.get(path)
            if tail is None:
                tail = self._tails[path] = StreamTail(path)
                self._batches[path] = []
            try:
                new = tail.poll()
            except Exception as exc:  # keep what we have from this stream
                tail.status.problem = f"unreadable: {exc}"
                new = []
            if new:
                self._batches[path].extend(new)
                changed = True
        if changed or self._frame is None:
            batches = [b.select(list(COLUMNS)) for bs in self._batches.values() for b in bs]
            table = pa.Table.from_batches(batches, schema=arrow_schema()) if batches \
                else arrow_schema().empty_table()
            self._frame = table_to_frame(table)
        data.records = self._frame
        data.streams = [t.status for t in self._tails.values()]
        self._warn(data)
        return data

    def _warn(self, data: RunData) -> None:
        now = time.time()
        if not data.streams:
            data.warnings.append(
                f"no metrics streams (*.arrows) in {self.run_dir}: the servers have not "
                "written any records yet, or metrics were not enabled for this run")
        for st in data.streams:
            msg = st.describe(STALE_AFTER_S, now)
            if msg:
                data.warnings.append(msg)
        names = {st.name.split(".")[0] for st in data.streams}
        for server in data.meta.get("servers", []):
            if server.get("id") and server["id"] not in names:
                data.warnings.append(f"server {server['id']} ({server.get('role')}) is in "
                                     "run.json but has no metrics stream: its data is missing")
        versions = {st.version for st in data.streams if st.version is not None}
        if versions - SUPPORTED_VERSIONS:
            data.warnings.append(f"schema versions {sorted(versions)} found; this dashboard "
                                 f"reads {sorted(SUPPORTED_VERSIONS)}")
        data.live = data.meta.get("finished") is None and any(
            st.live and now - st.mtime < STALE_AFTER_S for st in data.streams)
