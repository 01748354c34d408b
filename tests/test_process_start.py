"""engine.process_start: a CPU server forks its children where a probe shows fork is safe.

The probe's own cases run in fresh interpreters: this test process has run multi-threaded torch
ops already, which is exactly the state in which fork is unsafe."""
from __future__ import annotations

import subprocess
import sys

import pytest

from engine.process_start import ENV, StartMethod, choose, requested

PROBE_SCRIPT = """
import torch
from engine.process_start import fork_probe
torch.set_num_threads(2)
if {warm}:
    a = torch.ones(512, 512)
    (a @ a).sum(); torch.ones(1 << 20).mul_(2).sum()
print("WHY:", fork_probe(timeout_s=5.0))
"""


def _probe_in_fresh_interpreter(warm: bool) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE_SCRIPT.format(warm=warm)], capture_output=True,
                         text=True, timeout=120, env={"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split("WHY:", 1)[1].strip()


def test_requested_reads_the_environment():
    assert requested({}) is StartMethod.AUTO
    assert requested({ENV: " Spawn "}) is StartMethod.SPAWN
    assert requested({ENV: "fork"}) is StartMethod.FORK
    with pytest.raises(ValueError, match=f"{ENV}='forkserver': expected one of auto, fork, spawn"):
        requested({ENV: "forkserver"})


def test_choose_forks_a_cpu_server_only_where_the_probe_passes():
    probed = []

    def passes():
        probed.append(1)
        return None

    assert choose("cpu", StartMethod.AUTO, passes)[0] is StartMethod.FORK
    assert choose("cpu", StartMethod.FORK, passes) == (
        StartMethod.FORK, f"{ENV}=fork: the children inherit the launcher's imported modules")
    assert len(probed) == 2
    # The probe's reason is the log's reason; even HACK_PROCESS_START=fork does not fork then.
    method, why = choose("cpu", StartMethod.FORK, lambda: "an OpenMP team")
    assert (method, why) == (StartMethod.SPAWN, "an OpenMP team")
    # GPU servers and the opt-out keep spawn without probing.
    assert choose("cuda", StartMethod.AUTO, passes)[0] is StartMethod.SPAWN
    assert choose("cpu", StartMethod.SPAWN, passes) == (StartMethod.SPAWN, f"{ENV}=spawn")
    assert len(probed) == 2


def test_probe_passes_in_a_process_that_ran_no_threaded_op():
    assert _probe_in_fresh_interpreter(warm=False) == "None"


def test_probe_catches_the_openmp_team_that_would_hang_a_forked_child():
    why = _probe_in_fresh_interpreter(warm=True)
    assert "did not finish in 5 s" in why and "OpenMP" in why, why


PROMETHEUS_SCRIPT = """
import os, sys
import prometheus_client
from engine.process_start import prometheus_follows_environment
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]      # set after the import, as SGLang does
assert prometheus_follows_environment()
prometheus_client.Counter("probe_total", "a counter").inc()
print("FILES:", sorted(os.listdir(sys.argv[1])))
"""


def test_metrics_created_after_the_switch_reach_the_multiprocess_directory(tmp_path):
    # A forked scheduler inherits prometheus_client as the launcher imported it, before SGLang set
    # PROMETHEUS_MULTIPROC_DIR: without the switch its metrics stay in memory, off /metrics.
    out = subprocess.run([sys.executable, "-c", PROMETHEUS_SCRIPT, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    files = out.stdout.split("FILES:", 1)[1]
    assert "counter_" in files, files
