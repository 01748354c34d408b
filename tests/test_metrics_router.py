"""`hack dashboard --url ROUTER`: the HTTP client finds the workers through the real
sglang-router and reads every worker's /hack/events.

The workers here are small FastAPI apps that serve the real /hack routes (plus /health and
the info routes the router probes) over a recorded run; real SGLang servers serve the same
routes through the engine plugin."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests
import uvicorn
from fastapi import FastAPI

from engine.metrics.http_api import make_router
from hack_metrics.http_client import HttpRunLoader
from hack_metrics.run_view import build_view
from hack_metrics.runload import RunLoader
from engine.metrics.synthetic import SyntheticSpec, write_synthetic_run

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(run, server: str, port: int) -> uvicorn.Server:
    app = FastAPI()
    app.include_router(make_router(run, server))
    app.get("/health")(lambda: {})
    app.get("/get_server_info")(lambda: {})
    app.get("/get_model_info")(lambda: {"model_path": "recorded-run"})
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    deadline = time.time() + 20
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    return srv


def test_loader_follows_every_worker_behind_the_router(tmp_path):
    run = write_synthetic_run(SyntheticSpec(requests=20, seed=8), root=tmp_path)
    ports = {"prefill-0": _free_port(), "decode-0": _free_port()}
    workers = [_worker(run, name, port) for name, port in ports.items()]
    rport = _free_port()
    log = open(tmp_path / "router.log", "w")
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
         "--prefill", f"http://127.0.0.1:{ports['prefill-0']}",
         "--decode", f"http://127.0.0.1:{ports['decode-0']}",
         "--host", "127.0.0.1", "--port", str(rport)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{rport}"
    try:
        deadline = time.time() + 90
        listed = []
        while time.time() < deadline and len(listed) < 2:
            assert router.poll() is None, (tmp_path / "router.log").read_text()[-3000:]
            try:
                listed = requests.get(f"{url}/workers", timeout=2).json().get("workers", [])
            except (requests.RequestException, ValueError):
                time.sleep(0.5)
        assert len(listed) == 2, "the router did not list both workers in 90 s"
        data = HttpRunLoader(url).load()
        assert data.warnings == []
        local = RunLoader(run).load()
        assert len(data.records) == len(local.records) > 0
        assert sorted(set(data.records["server"])) == ["decode-0", "prefill-0"]
        view = build_view(data)
        assert view.requests["roles"].eq("decode,prefill").all() and len(view.requests) == 20
        assert data.meta["kv_mode"] == "hack"
    finally:
        os.killpg(router.pid, signal.SIGTERM)
        try:
            router.wait(3)
        except subprocess.TimeoutExpired:   # only the test's own router process group
            os.killpg(router.pid, signal.SIGKILL)
            router.wait(10)
        log.close()
        for w in workers:
            w.should_exit = True
