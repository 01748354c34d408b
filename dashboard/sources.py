"""Where the dashboard's data comes from: a run directory or a live server/router URL.

`Source` wraps the incremental loader of either kind and rebuilds the derived view only
when new records arrived (or, for a live run, when its open phases must grow to now).
No Streamlit here: the notebook uses the same code.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hack_metrics import rundir
from hack_metrics.http_client import HttpRunLoader
from hack_metrics.run_view import RunView, build_view
from hack_metrics.runload import RunLoader

HOW_TO_START = (
    "No run directory yet. A run directory is written by a HACK cluster started with "
    "`hack up` (each server writes its metrics into it), or by "
    "`hack dashboard --synthetic` (a clearly labelled synthetic run to try the "
    "dashboard). Runs live under $HACK_RUNS_DIR (default ~/.cache/sglang-hack/runs); "
    "open one with "
    "`hack dashboard --run-dir DIR`, or follow a live cluster with "
    "`hack dashboard --url http://ROUTER`.")


@dataclass(frozen=True)
class DashboardConfig:
    runs_root: Path
    run_dir: Path | None = None
    url: str | None = None
    refresh_s: float = 2.0
    servers: tuple[str, ...] = ()   # the servers behind `url` (from a cluster state)


def config_from_env() -> DashboardConfig:
    """The app's configuration, passed by `hack dashboard` through the environment."""
    run_dir = os.environ.get("HACK_DASHBOARD_RUN_DIR")
    try:
        refresh = float(os.environ.get("HACK_DASHBOARD_REFRESH_S", "2"))
    except ValueError:
        refresh = 2.0
    return DashboardConfig(runs_root=rundir.runs_root(),
                           run_dir=Path(run_dir) if run_dir else None,
                           url=os.environ.get("HACK_DASHBOARD_URL") or None,
                           refresh_s=max(0.5, refresh),
                           servers=tuple(u for u in os.environ.get(
                               "HACK_DASHBOARD_SERVERS", "").split(",") if u))


def run_choices(config: DashboardConfig) -> list[Path]:
    """Runs to offer, newest first; an explicit --run-dir outside the root comes first."""
    runs = rundir.list_runs(config.runs_root)
    if config.run_dir is not None and config.run_dir.resolve() not in \
            [r.resolve() for r in runs]:
        runs.insert(0, config.run_dir)
    return runs


def run_title(path: Path) -> str:
    """'name — label, kv mode, link' for pickers; tolerant of a broken run.json."""
    try:
        meta = rundir.read_run(path)
    except (FileNotFoundError, ValueError):
        return path.name
    bits = [meta.get("kv_mode"), meta.get("link_rate"),
            "synthetic" if meta.get("synthetic") else None]
    return f"{path.name} ({', '.join(b for b in bits if b)})"


class Source:
    """One run directory or URL, followed incrementally."""

    def __init__(self, target: str, kind: str, servers: tuple[str, ...] = ()) -> None:
        if kind not in ("dir", "url"):
            raise ValueError(f"source kind must be 'dir' or 'url', got {kind!r}")
        self.target, self.kind = target, kind
        self.loader = RunLoader(Path(target)) if kind == "dir" else \
            HttpRunLoader(target, servers=list(servers))
        self._lock = threading.Lock()
        self._sig: tuple | None = None
        self._view: RunView | None = None
        self._built_at = 0.0

    def view(self, live_rebuild_s: float = 1.0) -> RunView:
        with self._lock:
            data = self.loader.load()
            sig = (len(data.records), tuple((s.name, s.rows, s.closed, s.problem)
                                            for s in data.streams), data.live)
            stale = data.live and time.time() - self._built_at >= live_rebuild_s
            if self._view is None or sig != self._sig or stale:
                self._view = build_view(data)
                self._sig, self._built_at = sig, time.time()
            else:
                self._view.data = data   # fresh warnings (e.g. a stream went stale)
            return self._view


def load_view(run_dir: str | os.PathLike | None = None, url: str | None = None) -> RunView:
    """One-shot: the view of a run directory (default: the newest run) or of a URL."""
    if url:
        return Source(url, "url").view()
    path = Path(run_dir) if run_dir else rundir.newest_run()
    if path is None:
        raise FileNotFoundError(HOW_TO_START)
    return Source(str(path), "dir").view()
