"""Follow a live cluster over HTTP: the same RunData as `RunLoader`, from /hack/* routes.

Given a server URL (one that serves /hack/streams) it follows that server. Given a router
URL it follows the servers it is told about (`servers=`: `hack dashboard` passes those of the
cluster state that `hack up` wrote, which names each server's role and index; the mini-lb,
`hack up --router mini-lb`, lists no workers at all), or else asks the router for its workers
(`GET /workers`).
"""
from __future__ import annotations

import io
import json
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import requests

from hack_metrics.reader import StreamStatus
from hack_metrics.runload import RunData, table_to_frame
from hack_metrics.schema import COLUMNS, arrow_schema, check_schema, conform

MAX_PAGES = 50   # per stream and load: bounds one refresh on a huge backlog


def _urls_in(obj: Any) -> list[str]:
    """Every http(s) URL found anywhere in a JSON document."""
    if isinstance(obj, str):
        return [obj.rstrip("/")] if obj.startswith(("http://", "https://")) else []
    if isinstance(obj, dict):
        return [u for v in obj.values() for u in _urls_in(v)]
    if isinstance(obj, list):
        return [u for v in obj for u in _urls_in(v)]
    return []


class HttpRunLoader:
    def __init__(self, url: str, timeout: float = 3.0, servers: list[str] | None = None) -> None:
        self.url = url.rstrip("/")
        self.known_servers = [u.rstrip("/") for u in servers or []]
        self.timeout = timeout
        self._cursor: dict[tuple[str, str], int] = {}
        self._batches: dict[tuple[str, str], list[pa.RecordBatch]] = {}
        self._status: dict[tuple[str, str], StreamStatus] = {}
        self._meta: dict = {}
        self._lock = threading.Lock()

    def _get(self, url: str, **params: Any) -> requests.Response:
        return requests.get(url, params=params, timeout=self.timeout)

    def servers(self) -> tuple[list[str], list[str]]:
        """(server URLs that serve /hack/*, warnings)."""
        if self.known_servers:
            return self._check(self.known_servers, "server")
        try:
            if self._get(f"{self.url}/hack/streams").status_code == 200:
                return [self.url], []
        except requests.RequestException as exc:
            return [], [f"{self.url} is not reachable: {exc}"]
        try:
            r = self._get(f"{self.url}/workers")
            workers = sorted(set(_urls_in(r.json()))) if r.status_code == 200 else []
        except (requests.RequestException, json.JSONDecodeError, ValueError):
            workers = []
        if not workers:
            return [], [f"{self.url} serves no /hack/streams and lists no workers: is it a "
                        "HACK server or router with metrics enabled?"]
        return self._check(workers, "worker")

    def _check(self, urls: list[str], what: str) -> tuple[list[str], list[str]]:
        ok, warn = [], []
        for w in urls:
            try:
                code = self._get(f"{w}/hack/streams").status_code
                if code == 200:
                    ok.append(w)
                    continue
                why = f"answers HTTP {code} for /hack/streams"
            except requests.RequestException as exc:
                why = f"is not reachable ({type(exc).__name__})"
            warn.append(f"{what} {w} {why}: its metrics are missing")
        return ok, warn

    def load(self) -> RunData:
        with self._lock:
            data = RunData(source=self.url)
            servers, data.warnings = self.servers()
            for server in servers:
                self._follow(server, data)
            batches = [b.select(list(COLUMNS)) for bs in self._batches.values() for b in bs]
            table = pa.Table.from_batches(batches, schema=arrow_schema()) if batches \
                else arrow_schema().empty_table()
            data.records = table_to_frame(table)
            data.streams = list(self._status.values())
            data.meta = self._meta
            for st in data.streams:
                if st.problem:
                    data.warnings.append(f"{st.name}: {st.problem}")
            data.live = any(not st.closed for st in data.streams)
            if not data.streams and servers:
                data.warnings.append("the servers have no metrics streams yet")
            return data

    def _follow(self, server: str, data: RunData) -> None:
        try:
            listing = self._get(f"{server}/hack/streams").json()
            if not self._meta:
                r = self._get(f"{server}/hack/run")
                self._meta = r.json() if r.status_code == 200 else {}
        except (requests.RequestException, ValueError) as exc:
            data.warnings.append(f"{server}: cannot list streams: {exc}")
            return
        for s in listing.get("streams", []):
            key = (server, s["name"])
            st = self._status.setdefault(key, StreamStatus(path=Path(s["file"]),
                                                          label=f"{server} {s['name']}"))
            self._batches.setdefault(key, [])
            for _ in range(MAX_PAGES):
                try:
                    r = self._get(f"{server}/hack/events", stream=s["name"],
                                  since=self._cursor.get(key, 0), format="arrow",
                                  limit=20_000)
                    r.raise_for_status()
                    reader = pa.ipc.open_stream(io.BytesIO(r.content))
                    st.version = check_schema(reader.schema, st.name)
                    table = reader.read_all()
                except Exception as exc:
                    st.problem = f"reading events failed: {exc}"
                    break
                self._batches[key].extend(conform(b) for b in table.to_batches())  # an older server's version too
                st.rows += table.num_rows
                self._cursor[key] = int(r.headers.get("X-Hack-Next", 0))
                st.last_seq = self._cursor[key]
                st.closed = r.headers.get("X-Hack-Closed") == "1"
                st.problem = r.headers.get("X-Hack-Problem") or None
                if r.headers.get("X-Hack-More") != "1":
                    break

