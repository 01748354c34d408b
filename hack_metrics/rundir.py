"""Run directories: `<runs root>/<YYYYmmdd-HHMMSS>-<label>/` with `run.json` + streams.

The runs root is `$HACK_RUNS_DIR` if set, else `~/.cache/sglang-hack/runs` (one default for
every command: `hack up`, `hack serve`, `hack bench serve`, `hack bench disagg`, `hack demo`
write there, `hack dashboard` reads there).
`run.json` (format version 1) holds what the dashboard cannot learn from the streams:

    {"run_format": 1, "label": "hack-200mbit", "kv_mode": "hack", "link_rate": "200mbit",
     "created": "2025-01-01T12:00:00+00:00", "finished": null, "synthetic": false,
     "router": "http://127.0.0.1:8000",
     "servers": [{"id": "prefill-0", "role": "prefill", "url": "http://127.0.0.1:30000"}]}

Writers update it with an atomic replace under an exclusive file lock, so a launcher and
servers may register concurrently.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

RUN_FORMAT = 1
RUN_JSON = "run.json"
_LABEL_RE = re.compile(r"[^A-Za-z0-9_.-]+")


RUNS_ROOT_VAR = "HACK_RUNS_DIR"
DEFAULT_RUNS_ROOT = "~/.cache/sglang-hack/runs"
RUNS_ROOT_HELP = f"${RUNS_ROOT_VAR}, default {DEFAULT_RUNS_ROOT}"


def runs_root() -> Path:
    """Where run directories live: $HACK_RUNS_DIR, else ~/.cache/sglang-hack/runs.
    Not the current directory: `hack up` and `hack dashboard` run from different places."""
    return Path(os.environ.get(RUNS_ROOT_VAR) or DEFAULT_RUNS_ROOT).expanduser()


def _initial_meta(label: str, kv_mode: str, link_rate: str | None, router: str | None,
                  synthetic: bool, extra: dict | None, now: dt.datetime) -> dict:
    meta = {"run_format": RUN_FORMAT, "label": label, "kv_mode": kv_mode,
            "link_rate": link_rate, "created": now.isoformat(timespec="seconds"),
            "finished": None, "synthetic": bool(synthetic), "router": router,
            "servers": []}
    meta.update(extra or {})
    return meta


def clean_label(label: str) -> str:
    return _LABEL_RE.sub("-", label).strip("-") or "run"


def create_run(label: str, kv_mode: str, *, link_rate: str | None = None,
               root: str | os.PathLike | None = None, router: str | None = None,
               synthetic: bool = False, extra: dict | None = None,
               now: dt.datetime | None = None) -> Path:
    """Make a new run directory and its run.json; returns its path."""
    clean = clean_label(label)
    now = now or dt.datetime.now(dt.timezone.utc)
    base = Path(root) if root is not None else runs_root()
    base.mkdir(parents=True, exist_ok=True)
    stamp = now.astimezone().strftime("%Y%m%d-%H%M%S")
    for n in range(100):
        path = base / (f"{stamp}-{clean}" if n == 0 else f"{stamp}-{clean}-{n}")
        try:
            path.mkdir()
            break
        except FileExistsError:
            continue
    else:
        raise RuntimeError(f"could not create a run directory for {clean!r} in {base}")
    _write_json(path / RUN_JSON, _initial_meta(clean, kv_mode, link_rate, router, synthetic,
                                               extra, now))
    return path


def init_run(path: str | os.PathLike, label: str, kv_mode: str, *,
             link_rate: str | None = None, extra: dict | None = None, join: bool = False) -> Path:
    """Use a given directory as a run directory: a fresh run.json replaces an old one (a
    directory reused by a new cluster is a new run). `join`: the run of several servers started
    apart (the containers of a compose stack): the first to arrive writes run.json, the others
    keep it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        if not (join and (path / RUN_JSON).exists()):
            _write_json(path / RUN_JSON, _initial_meta(clean_label(label), kv_mode, link_rate, None,
                                                       False, extra, dt.datetime.now(dt.timezone.utc)))
    return path


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    with open(run_dir / ".run.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def update_run(run_dir: str | os.PathLike, **changes: Any) -> dict:
    """Set top-level fields of run.json atomically; returns the new contents."""
    run_dir = Path(run_dir)
    with _locked(run_dir):
        meta = read_run(run_dir)
        meta.update(changes)
        _write_json(run_dir / RUN_JSON, meta)
    return meta


def register_server(run_dir: str | os.PathLike, server_id: str, role: str,
                    url: str | None = None, **extra: Any) -> dict:
    """Add or replace one server entry in run.json (`extra`: e.g. pid)."""
    run_dir = Path(run_dir)
    with _locked(run_dir):
        meta = read_run(run_dir)
        servers = [s for s in meta.get("servers", []) if s.get("id") != server_id]
        servers.append({"id": server_id, "role": role, "url": url, **extra})
        meta["servers"] = sorted(servers, key=lambda s: s["id"])
        _write_json(run_dir / RUN_JSON, meta)
    return meta


def mark_finished(run_dir: str | os.PathLike) -> dict:
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return update_run(run_dir, finished=now)


def read_run(run_dir: str | os.PathLike) -> dict:
    """The run.json of a run directory; raises ValueError with the reason if unusable."""
    path = Path(run_dir) / RUN_JSON
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path} must hold a JSON object")
    fmt = meta.get("run_format")
    if fmt != RUN_FORMAT:
        raise ValueError(f"{path}: run format {fmt!r} is not supported (expected {RUN_FORMAT})")
    return meta


def list_runs(root: str | os.PathLike | None = None) -> list[Path]:
    """Run directories under `root` (those holding run.json or .arrows), newest first."""
    base = Path(root) if root is not None else runs_root()
    if not base.is_dir():
        return []
    runs = [p for p in base.iterdir()
            if p.is_dir() and ((p / RUN_JSON).exists() or any(p.glob("*.arrows")))]
    # Names start with a timestamp; ties broken by modification time.
    return sorted(runs, key=lambda p: (p.name[:15], p.stat().st_mtime), reverse=True)


def newest_run(root: str | os.PathLike | None = None) -> Path | None:
    runs = list_runs(root)
    return runs[0] if runs else None


def stream_files(run_dir: str | os.PathLike) -> list[Path]:
    return sorted(Path(run_dir).glob("*.arrows"))
