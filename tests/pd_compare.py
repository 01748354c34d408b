"""Shared by the end-to-end tests that hold a 1P1D cluster's greedy tokens to a colocated
server's: the same prompts through each (the two start together; the colocated one serves once
the cluster has), always stopped. Not a test module (no test_ prefix)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from disagg import cluster, procs
from disagg.replay import generate
from disagg.server_cmd import server_command
from disagg.wire_meter import read_log
from engine.cpu_runtime import shared_host_env
from engine.launcher import free_port


def cluster_runs(spec: Any, prompts: dict[int, list[int]], n_new: int, request: Any,
                 before_down: Callable[[dict, dict], None] | None = None) -> dict:
    """Every prompt through the cluster `spec` starts: its result and the prefill's wire records
    of it; before_down(state, out) may read the servers before the cluster stops."""
    state = cluster.up(spec, log=lambda m: None)
    request.addfinalizer(lambda: cluster.down(state))
    wire = Path(state["run_dir"]) / "wire-prefill-0.jsonl"
    out: dict = {"results": {}, "wire": {}}
    for n, ids in prompts.items():
        before = len(read_log(wire))
        out["results"][n] = generate(state["router_url"], ids, n_new, stream=False)
        out["wire"][n] = read_log(wire)[before:]
    if before_down is not None:
        before_down(state, out)
    cluster.down(state)
    return out


def spawn_colocated(model_path: str, label: str, extra: list[str], max_total_tokens: int,
                    request: Any) -> tuple[str, int, Path]:
    """Start one colocated `hack` server with the cluster's server flags (`extra` on top of
    disagg.server_cmd's) without waiting for it: (url, pid, log). Started before the cluster, the
    two starts overlap (each is most of a minute of this machine; the peak is three servers)."""
    run_dir = Path(cluster.default_run_root()) / f"{label}-colocated-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = server_command("colocated", "hack", model_path, "127.0.0.1", port, None, max_total_tokens, extra)
    log = run_dir / "colocated.log"
    pid = procs.spawn(cmd, shared_host_env(dict(os.environ, SGLANG_USE_CPU_ENGINE="1")), log)
    request.addfinalizer(lambda: procs.stop(pid))
    return f"http://127.0.0.1:{port}", pid, log


def colocated_runs(spawned: tuple[str, int, Path], prompts: dict[int, list[int]], n_new: int,
                   startup_timeout_s: float) -> dict:
    """The same prompts through the server `spawn_colocated` started, once it is up; then it stops."""
    url, pid, log = spawned
    cluster.wait_healthy([url + "/health"], [pid], startup_timeout_s, [log])
    out = {n: generate(url, ids, n_new, stream=False) for n, ids in prompts.items()}
    procs.stop(pid)
    return out


def assert_same_greedy_tokens(pd_runs: dict, colocated: dict, lengths: tuple[int, ...], n_new: int) -> None:
    """The cluster's greedy tokens equal the colocated server's, prompt by prompt."""
    for n in lengths:
        got, ref = pd_runs["results"][n], colocated[n]
        assert got.ok and ref.ok, (got.error, ref.error)
        assert len(ref.output_ids) == n_new
        assert got.output_ids == ref.output_ids, f"{n}-token prompt: PD {got.output_ids} vs colocated {ref.output_ids}"


def checked_wire_bytes(pd_runs: dict, n: int, predicted: int, tolerance: float) -> int:
    """Bytes of the n-token prompt's one wire record, held to the layout's prediction."""
    recs = pd_runs["wire"][n]
    assert len(recs) == 1
    assert abs(recs[0]["bytes"] - predicted) <= tolerance * predicted, (n, recs[0]["bytes"], predicted)
    return recs[0]["bytes"]
