"""Live HTTP access to metrics streams: /hack/events?since=, /hack/streams, the client."""
from __future__ import annotations

from hack_metrics import schema as S

import io
import socket
import threading
import time

import pyarrow as pa
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from hack_metrics import rundir
from engine.metrics.http_api import create_app, install_routes
from hack_metrics.http_client import HttpRunLoader
from hack_metrics.runload import RunLoader
from engine.metrics.sink import MetricsSink


@pytest.fixture
def run(tmp_path):
    run = rundir.create_run("http", "hack", root=tmp_path)
    sink = MetricsSink(run, "prefill", "0", strict=True)
    for i in range(5):
        sink.record("arrival", f"r{i}", room=i)
    sink.flush()
    yield run, sink
    sink.close()


def test_events_since_and_limit(run):
    run_dir, sink = run
    client = TestClient(create_app(run_dir, "prefill-0"))
    body = client.get("/hack/events", params={"since": 0}).json()
    assert [e["seq"] for e in body["events"]] == [1, 2, 3, 4, 5]
    assert body["next"] == 5 and body["more"] is False and body["closed"] is False
    assert body["schema_version"] == S.SCHEMA_VERSION and body["stream"] == "prefill-0"
    body = client.get("/hack/events", params={"since": 3}).json()
    assert [e["rid"] for e in body["events"]] == ["r3", "r4"]
    body = client.get("/hack/events", params={"since": 1, "limit": 2}).json()
    assert [e["seq"] for e in body["events"]] == [2, 3] and body["more"] and body["next"] == 3
    # New records appear on the next call; nothing is repeated.
    sink.record("finish", "r0", room=0, tokens=9)
    sink.flush()
    body = client.get("/hack/events", params={"since": 5}).json()
    assert [(e["seq"], e["kind"], e["tokens"]) for e in body["events"]] == [(6, "finish", 9)]
    sink.close()
    assert client.get("/hack/events", params={"since": 6}).json()["closed"] is True


def test_arrow_format_and_errors(run):
    run_dir, sink = run
    client = TestClient(create_app(run_dir))
    r = client.get("/hack/events", params={"since": 2, "format": "arrow"})
    assert r.headers["content-type"] == "application/vnd.apache.arrow.stream"
    table = pa.ipc.open_stream(io.BytesIO(r.content)).read_all()
    assert table.column("seq").to_pylist() == [3, 4, 5]
    assert r.headers["X-Hack-Next"] == "5" and r.headers["X-Hack-More"] == "0"
    streams = client.get("/hack/streams").json()["streams"]
    assert [(s["name"], s["last_seq"]) for s in streams] == [("prefill-0", 5)]
    assert client.get("/hack/events", params={"stream": "nope"}).status_code == 404
    assert client.get("/hack/events", params={"since": -1}).status_code == 422
    assert client.get("/hack/events", params={"format": "xml"}).status_code == 422
    other = MetricsSink(run_dir, "decode", "0")
    other.record("arrival", "d")
    other.close()
    r = client.get("/hack/events")
    assert r.status_code == 400 and "pass stream=" in r.json()["detail"]
    assert client.get("/hack/run").json()["label"] == "http"


def test_install_routes_uses_the_environment(run, monkeypatch):
    run_dir, _ = run
    monkeypatch.delenv("HACK_METRICS_RUN_DIR", raising=False)
    assert install_routes(FastAPI()) is False
    monkeypatch.setenv("HACK_METRICS_RUN_DIR", str(run_dir))
    monkeypatch.setenv("HACK_METRICS_ROLE", "prefill")
    app = FastAPI()
    assert install_routes(app) is True
    body = TestClient(app).get("/hack/streams").json()
    assert body["server"] == "prefill-0" and body["streams"][0]["rows"] == 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_http_loader_matches_the_files(run):
    run_dir, sink = run
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(run_dir), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 20
        while not server.started and time.time() < deadline:
            time.sleep(0.05)
        loader = HttpRunLoader(f"http://127.0.0.1:{port}")
        first = loader.load()
        assert first.warnings == [] and len(first.records) == 5 and first.live
        assert first.meta["label"] == "http"
        sink.record("finish", "r1", room=1, tokens=3)
        sink.close()
        second = loader.load()
        local = RunLoader(run_dir).load()
        assert second.records["seq"].tolist() == local.records["seq"].tolist() == list(range(1, 7))
        assert not second.live
        bad = HttpRunLoader(f"http://127.0.0.1:{_free_port()}", timeout=1).load()
        assert "not reachable" in bad.warnings[0] and not bad.has_data
    finally:
        server.should_exit = True
        thread.join(10)
