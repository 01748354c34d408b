"""`hack up` + a request + `hack down`, and `hack demo` headless: real servers, real router,
a real shaped link (root). Asserts that nothing is left behind: processes, namespaces, veths."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disagg import netns, procs
from disagg.replay import generate

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _hack(*args: str, env: dict, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hack_cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture()
def env(tmp_path):
    from hack_eval.models import model_dir

    if not model_dir().exists():
        pytest.skip("model not prepared (hack model prepare smollm2)")
    return dict(os.environ, HACK_CLUSTER_STATE_DIR=str(tmp_path / "state"), HACK_RUNS_DIR=str(tmp_path / "runs"))


@pytest.mark.skipif(os.geteuid() != 0, reason="the shaped link needs root")
def test_hack_up_request_hack_down_leaves_nothing(env):
    up = _hack("up", "--kv", "hack", "--link-mbps", "500", "--json", env=env)
    state = json.loads(up.stdout) if up.returncode == 0 else None
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        assert state["link"]["namespace"] in netns.list_namespaces()
        res = generate(state["router_url"], list(range(100, 180)), 4, stream=False)
        assert res.ok and len(res.output_ids) == 4, res.error
        wire = [json.loads(line) for line in open(os.path.join(state["run_dir"], "wire-prefill-0.jsonl"))]
        assert len(wire) == 1 and wire[0]["bytes"] > 0
    finally:
        down = _hack("down", env=env, timeout=300)
    assert down.returncode == 0, down.stderr
    assert "stopped prefill-0" in down.stdout and "removed" in down.stdout
    assert not any(procs.alive(s["pid"]) for s in state["servers"])
    assert state["link"]["namespace"] not in netns.list_namespaces()
    assert state["link"]["veth_root"] not in netns.list_veths()
    assert "nothing to stop" in _hack("down", env=env, timeout=120).stdout


def test_hack_up_refuses_bad_input_without_starting_anything(env):
    bad = _hack("up", "--prefill", "0", env=env, timeout=300)
    assert bad.returncode == 2 and "at least one prefill" in bad.stderr
    bad = _hack("up", "--model", "/nonexistent/model", env=env, timeout=300)
    assert bad.returncode == 2 and "unknown model" in bad.stderr


def test_hack_demo_headless_compares_bf16_and_hack_and_stops_cleanly(env):
    demo = _hack("demo", "--no-dashboard", "--duration", "3", "--requests", "1", env=env, timeout=1500)
    out = demo.stdout + demo.stderr
    assert demo.returncode == 0, out[-3000:]
    assert "comparison" in out and "bf16" in out and "hack" in out
    assert "stopped: servers, router, dashboard and links are gone" in out
    started = [json.loads(p.read_text()) for p in Path(env["HACK_RUNS_DIR"]).glob("*-demo-*/cluster.json")]
    assert {s["kv"] for s in started} == {"bf16", "hack"}
    names = {s["link"]["namespace"] for s in started if s.get("link")}
    assert not names & set(netns.list_namespaces())
    assert not any(procs.alive(srv["pid"]) for s in started for srv in s["servers"])
    assert not os.listdir(env["HACK_CLUSTER_STATE_DIR"])
