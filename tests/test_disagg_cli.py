"""`hack up` refusing bad input, and `hack demo` headless: real servers, real router, a real shaped
link (root). Asserts that nothing is left behind: processes, namespaces, veths. `hack up` + requests +
`hack down` on a real cluster is tests/test_operator_e2e.py's module cluster."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disagg import netns, procs

pytestmark = [pytest.mark.memory_heavy, pytest.mark.slow, pytest.mark.e2e]


def _hack(*args: str, env: dict, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hack_cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture()
def env(tmp_path):
    from hack_eval.models import model_dir

    if not model_dir().exists():
        pytest.skip("model not prepared (hack model prepare smollm2)")
    return dict(os.environ, HACK_CLUSTER_STATE_DIR=str(tmp_path / "state"), HACK_RUNS_DIR=str(tmp_path / "runs"))


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
