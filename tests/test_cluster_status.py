"""`hack status`, cluster lookup for `hack dashboard --cluster/--url`, run.json of a cluster,
and the one runs root: on state files and real local processes (no model, no servers)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from disagg import cluster
from hack_metrics import rundir
from hack_cli import cmd_dashboard
from hack_cli.main import build_parser, main


@pytest.fixture()
def state_dir(tmp_path, monkeypatch):
    d = tmp_path / "state"
    monkeypatch.setenv("HACK_CLUSTER_STATE_DIR", str(d))
    monkeypatch.setenv("HACK_RUNS_DIR", str(tmp_path / "runs"))
    return d


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def healthy_url():
    srv = HTTPServer(("127.0.0.1", 0), _Health)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()


def _write_state(state_dir, name: str, servers: list[dict], **kw) -> dict:
    state_dir.mkdir(parents=True, exist_ok=True)
    st = {"name": name, "kv": "hack", "link_mbps": 200.0, "run_dir": f"/runs/{name}",
          "model_path": "/m", "owner_pid": "detached", "servers": servers, "pids": [],
          "link": None, "router_url": next((s["url"] for s in servers if s["role"] == "router"),
                                           None), "started": 1.0, "ready": 2.0, **kw}
    (state_dir / f"{name}.json").write_text(json.dumps(st))
    return st


def test_status_reports_live_degraded_and_stale_clusters(state_dir, healthy_url, capsys):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        _write_state(state_dir, "live01", [
            {"role": "prefill", "index": 0, "pid": sleeper.pid, "url": healthy_url},
            {"role": "decode", "index": 0, "pid": sleeper.pid, "url": "http://127.0.0.1:9"},
        ])
        _write_state(state_dir, "gone02", [
            {"role": "decode", "index": 0, "pid": dead.pid, "url": "http://127.0.0.1:9"}])
        assert main(["status", "--json"]) == 0
        report = {c["name"]: c for c in json.loads(capsys.readouterr().out)["clusters"]}
        live = report["live01"]
        assert live["state"] == "degraded" and live["kv"] == "hack" and live["link_mbps"] == 200
        assert [s["health"] for s in live["servers"]] == ["ok", "unreachable"]
        assert live["servers"][0]["pid"] == sleeper.pid and live["run_dir"] == "/runs/live01"
        assert report["gone02"]["state"] == "stale"
        assert report["gone02"]["servers"][0]["health"] == "process gone"
        assert main(["status"]) == 0
        text = capsys.readouterr().out
        assert "cluster gone02: STALE" in text and "hack down --name gone02" in text
        assert f"prefill-0  {sleeper.pid:>8}  ok" in text and "200 Mbit/s" in text
    finally:
        sleeper.kill()
        sleeper.wait()
    # Stale state is reported, never silently dropped by `hack status` itself.
    assert (state_dir / "gone02.json").exists()


def test_status_without_clusters_says_how_to_start(state_dir, capsys):
    assert main(["status"]) == 0
    assert "no clusters" in capsys.readouterr().out


def test_dashboard_follows_a_cluster_through_its_state(state_dir):
    _write_state(state_dir, "abc123", [
        {"role": "prefill", "index": 0, "pid": 1, "url": "http://10.211.0.2:30001"},
        {"role": "decode", "index": 0, "pid": 1, "url": "http://10.211.0.1:30002"},
        {"role": "router", "index": 0, "pid": 1, "url": "http://127.0.0.1:30003"}])
    for argv in (["--cluster", "abc123"], ["--url", "http://127.0.0.1:30003/"]):
        env, what = cmd_dashboard.dashboard_env(build_parser().parse_args(["dashboard", *argv]))
        assert env["HACK_DASHBOARD_SERVERS"] == "http://10.211.0.2:30001,http://10.211.0.1:30002"
        assert env["HACK_DASHBOARD_URL"].startswith("http://127.0.0.1:30003")
        assert "abc123" in what
    env, _ = cmd_dashboard.dashboard_env(build_parser().parse_args(
        ["dashboard", "--url", "http://127.0.0.1:1"]))
    assert "HACK_DASHBOARD_SERVERS" not in env        # not a known cluster: ask its /workers
    with pytest.raises(ValueError, match="no cluster named 'nope'.*abc123"):
        cmd_dashboard.dashboard_env(build_parser().parse_args(["dashboard", "--cluster", "nope"]))


def test_one_runs_root_everywhere(tmp_path, monkeypatch):
    monkeypatch.delenv("HACK_RUNS_DIR", raising=False)
    assert rundir.runs_root() == cluster.default_run_root()
    assert rundir.runs_root() == rundir.Path(os.path.expanduser("~/.cache/sglang-hack/runs"))
    monkeypatch.setenv("HACK_RUNS_DIR", str(tmp_path))
    assert cluster.default_run_root() == tmp_path == rundir.runs_root()
    for cmd in ("dashboard", "up"):
        help_text = build_parser()._subparsers._group_actions[0].choices[cmd].format_help()
        assert "$HACK_RUNS_DIR" in " ".join(help_text.split())
        assert "~/.cache/sglang-hack/runs" in help_text


def test_run_json_of_a_given_directory_is_fresh(tmp_path):
    run = rundir.init_run(tmp_path / "r", "hack-200mbit", "hack", link_rate="200mbit",
                          extra={"command": "hack up --kv hack", "model": "m"})
    rundir.register_server(run, "prefill-0", "prefill", "http://10.211.0.2:1", pid=42)
    rundir.mark_finished(run)
    run = rundir.init_run(run, "hack-200mbit", "hack", link_rate="200mbit")
    meta = rundir.read_run(run)
    assert meta["finished"] is None and meta["servers"] == [] and meta["kv_mode"] == "hack"
