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


def essay_prompts(model_path: str, lengths: tuple[int, ...]) -> dict[int, list[int]]:
    """One essay prompt per length, each from its own essay: the prompts these tests send."""
    from hack_eval.workloads import essay_ids

    return {n: essay_ids(model_path, n, index=i) for i, n in enumerate(lengths)}


Spawned = tuple[str, int, Path]  # (url, pid, log) of a server started without waiting for it


def spawn_server(model_path: str, label: str, role: str, method: str, extra: list[str], max_total_tokens: int,
                 request: Any, bootstrap_port: int | None = None, env: dict | None = None) -> Spawned:
    """Start one server of disagg.server_cmd (`extra` on top of its flags) on 127.0.0.1 without
    waiting for it; stopped by `request`'s finalizer at the latest. Started before a cluster, the
    starts overlap (each is most of a minute of this machine)."""
    run_dir = Path(cluster.default_run_root()) / f"{label}-{role}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = server_command(role, method, model_path, "127.0.0.1", port, bootstrap_port, max_total_tokens, extra)
    log = run_dir / f"{role}.log"
    pid = procs.spawn(cmd, shared_host_env(dict(os.environ, SGLANG_USE_CPU_ENGINE="1", **(env or {}))), log)
    request.addfinalizer(lambda: procs.stop(pid))
    return f"http://127.0.0.1:{port}", pid, log


def spawn_colocated(model_path: str, label: str, extra: list[str], max_total_tokens: int, request: Any) -> Spawned:
    """The colocated `hack` server with the cluster's server flags: a PD pair's greedy reference."""
    return spawn_server(model_path, label, "colocated", "hack", extra, max_total_tokens, request)


def wait_up(spawned: Spawned, timeout_s: float = 900.0) -> str:
    """The server's URL once it answers /health (its log's last lines if it died starting)."""
    url, pid, log = spawned
    cluster.wait_healthy([url + "/health"], [pid], timeout_s, [log])
    return url


def colocated_runs(spawned: Spawned, prompts: dict[int, list[int]], n_new: int, startup_timeout_s: float) -> dict:
    """The same prompts through the server `spawn_colocated` started, once it is up; then it stops."""
    url = wait_up(spawned, startup_timeout_s)
    out = {n: generate(url, ids, n_new, stream=False) for n, ids in prompts.items()}
    procs.stop(spawned[1])
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
