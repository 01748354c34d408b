"""Live HTTP access to a server's metrics streams (FastAPI routes).

Chosen design: the routes read the server's stream files from the run directory. The
records are written by SGLang's scheduler process while the HTTP server lives in
another process (the tokenizer manager's), so the file is the one place both can see;
it also makes the same routes work on a finished run, from a standalone server
(`python -m engine.metrics.http_api --run-dir DIR --port N`).

Routes:
  GET /hack/streams                         the streams, their last seq and state
  GET /hack/events?since=<seq>&stream=<name>&limit=<n>&format=json|arrow
        records of one stream with seq > since (seq counts 1, 2, ... per stream), oldest
        first, at most `limit`. `stream` may be left out when there is one stream (or
        one named exactly like the server). JSON: {"schema_version", "stream", "events":
        [...], "next": <seq to pass as since>, "more": bool, "closed": bool, "problem"}.
        Arrow: an IPC stream body, with the same fields in X-Hack-* headers.
  GET /hack/run                             run.json of the run directory

Inside SGLang: `install_routes(app)` (the engine's hook registry calls it on SGLang's
FastAPI app); it reads HACK_METRICS_RUN_DIR / _ROLE / _INSTANCE like the sink does.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import threading
from pathlib import Path

import pyarrow as pa
from fastapi import APIRouter, FastAPI, HTTPException, Query
from fastapi.responses import Response

from hack_metrics import rundir
from hack_metrics.reader import StreamTail
from hack_metrics.schema import SCHEMA_VERSION, arrow_schema

MAX_LIMIT = 100_000


class StreamIndex:
    """The streams of one server (or of all servers) in a run directory, kept in memory."""

    def __init__(self, run_dir: Path, server: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.server = server
        self._tails: dict[str, StreamTail] = {}
        self._batches: dict[str, list[pa.RecordBatch]] = {}
        self._lock = threading.Lock()

    def _mine(self, name: str) -> bool:
        return self.server is None or name == self.server or \
            name.startswith(self.server + ".")

    def refresh(self) -> None:
        with self._lock:
            for path in rundir.stream_files(self.run_dir):
                name = path.name[: -len(".arrows")]
                if not self._mine(name):
                    continue
                if name not in self._tails:
                    self._tails[name] = StreamTail(path)
                    self._batches[name] = []
                self._batches[name].extend(self._tails[name].poll())

    def streams(self) -> list[dict]:
        self.refresh()
        return [{"name": n, "file": t.path.name, "last_seq": t.status.last_seq,
                 "rows": t.status.rows, "closed": t.status.closed,
                 "problem": t.status.problem} for n, t in sorted(self._tails.items())]

    def resolve(self, stream: str | None) -> str:
        names = sorted(self._tails)
        if stream is not None:
            if stream not in self._tails:
                raise HTTPException(404, f"no stream {stream!r}; streams: {names}")
            return stream
        if len(names) == 1:
            return names[0]
        if self.server in self._tails:
            return self.server
        raise HTTPException(400, f"several streams, pass stream=<name>: {names}")

    def since(self, stream: str | None, since: int, limit: int) -> tuple[str, pa.Table, bool]:
        """(name, records with seq > since (at most limit), whether more follow)."""
        self.refresh()
        name = self.resolve(stream)
        with self._lock:
            picked = []
            for batch in self._batches[name]:
                seq = batch.column("seq")
                if batch.num_rows == 0 or seq[-1].as_py() <= since:
                    continue
                first = seq[0].as_py()
                picked.append(batch.slice(max(0, since - first + 1)))
            schema = self._tails[name].schema
        # batches are in the current schema whatever version wrote the file (reader.conform)
        table = pa.Table.from_batches(picked, schema=arrow_schema()) if schema is not None \
            else arrow_schema().empty_table()
        more = table.num_rows > limit
        return name, table.slice(0, limit), more

    def status(self, name: str) -> dict:
        st = self._tails[name].status
        return {"closed": st.closed, "problem": st.problem}


def make_router(run_dir: str | os.PathLike, server: str | None = None) -> APIRouter:
    index = StreamIndex(Path(run_dir), server)
    router = APIRouter()

    @router.get("/hack/streams")
    def streams() -> dict:
        return {"schema_version": SCHEMA_VERSION, "server": server,
                "run_dir": str(index.run_dir), "streams": index.streams()}

    @router.get("/hack/events")
    def events(since: int = Query(0, ge=0), stream: str | None = None,
               limit: int = Query(5000, ge=1, le=MAX_LIMIT),
               format: str = Query("json", pattern="^(json|arrow)$")) -> Response:
        name, table, more = index.since(stream, since, limit)
        nxt = int(table.column("seq")[-1].as_py()) if table.num_rows else since
        st = index.status(name)
        if format == "arrow":
            buf = io.BytesIO()
            with pa.ipc.new_stream(buf, table.schema) as w:
                w.write_table(table)
            headers = {"X-Hack-Stream": name, "X-Hack-Next": str(nxt),
                       "X-Hack-More": str(int(more)), "X-Hack-Closed": str(int(st["closed"])),
                       "X-Hack-Problem": (st["problem"] or "").encode("ascii", "replace")
                       .decode()[:500]}
            return Response(buf.getvalue(), media_type="application/vnd.apache.arrow.stream",
                            headers=headers)
        body = {"schema_version": SCHEMA_VERSION, "stream": name, "next": nxt,
                "more": more, **st, "events": table.to_pylist()}
        return Response(json.dumps(body), media_type="application/json")

    @router.get("/hack/run")
    def run() -> dict:
        try:
            return rundir.read_run(index.run_dir)
        except (FileNotFoundError, ValueError) as exc:
            raise HTTPException(404, str(exc)) from None

    return router


def install_routes(app: FastAPI, run_dir: str | os.PathLike | None = None,
                   server: str | None = None) -> bool:
    """Add the /hack/* routes to `app`; False (and nothing added) when metrics are off."""
    run_dir = run_dir or os.environ.get("HACK_METRICS_RUN_DIR")
    if not run_dir or getattr(app.state, "hack_routes", False):
        return False
    if server is None:
        server = (f"{os.environ.get('HACK_METRICS_ROLE', 'colocated')}-"
                  f"{os.environ.get('HACK_METRICS_INSTANCE', '0')}")
    app.include_router(make_router(run_dir, server))
    app.state.hack_routes = True    # once per app, however many times a hook fires
    return True


def create_app(run_dir: str | os.PathLike, server: str | None = None) -> FastAPI:
    """A standalone app serving one run directory (all servers unless `server`)."""
    app = FastAPI(title="HACK metrics")
    app.include_router(make_router(run_dir, server))
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Serve a run directory's metrics over HTTP")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--server", default=None, help="only this server's streams")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    a = p.parse_args(argv)
    import uvicorn
    uvicorn.run(create_app(a.run_dir, a.server), host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
