"""Gemma-3-270M through prefill/decode disaggregation: the cluster `hack up --model gemma3` starts
(one prefill, one decode, the PD router, mooncake over TCP on loopback) gives the colocated
`--kv-cache-dtype hack` server's greedy tokens, on prompts longer than the 512-token window.

Why equality is the bar: both sides run the same kernels on the same pages, so the only
difference is the transfer. The decode server must receive every full 2-bit page of every
layer (its pool keeps all tokens; the window is applied when attention reads; `hack` sends the
pages without K's code sums, which decode rebuilds), the FP16 open partition and the FP16
sinks; anything lost there changes the window layers' or the full layers' scores and, greedy,
the tokens. The wire bytes are checked against that layout too.

Every server runs with --disable-radix-cache, so every request is a cold prefill on both sides
(cached-prefix and cold prefill are numerically different paths). One cluster and one
colocated server, started together, serve all assertions and are always stopped.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from pd_compare import assert_same_greedy_tokens, checked_wire_bytes, cluster_runs, spawn_colocated
from pd_compare import colocated_runs as colocated_runs_of

pytestmark = [pytest.mark.memory_heavy, pytest.mark.integration, pytest.mark.slow, pytest.mark.e2e]

NO_RADIX = ["--disable-radix-cache"]
MAX_TOTAL_TOKENS = 8192
WINDOW = 512  # Gemma-3-270M's sliding_window (HF); 5 of its 6 layers in a group use it
# Longer than the window (the window layers drop the first keys), neither a multiple of the
# page size (an FP16 open partition travels) nor equal to each other's page count.
PROMPT_LENGTHS = (700, 1090)
N_NEW = 8
WIRE_TOLERANCE = 0.01  # measured bytes vs the layout's prediction (the metadata row is ~1 KB)
STARTUP_TIMEOUT_S = 900.0  # three servers loading a 270M model on a shared 2-core machine


@pytest.fixture(scope="module")
def model_path() -> str:
    from hack_eval.models import prepare

    return str(prepare("gemma3", log=lambda *a, **k: None))


def _pd_spec(model_path: str):
    """The ClusterSpec of `hack up --model gemma3 --kv hack`, radix cache off."""
    from hack_cli.cmd_cluster import spec_from_args
    from hack_cli.main import build_parser

    args = build_parser().parse_args(["up", "--model", "gemma3", "--kv", "hack",
                                      "--max-total-tokens", str(MAX_TOTAL_TOKENS)])
    spec = spec_from_args(args)
    assert spec.model_path == model_path
    spec.extra_server_args = list(NO_RADIX)
    spec.health_timeout_s = STARTUP_TIMEOUT_S
    return spec


def _prompts(model_path: str) -> dict[int, list[int]]:
    return {n: _prompt(model_path, n, index=i) for i, n in enumerate(PROMPT_LENGTHS)}


# Memory: a Gemma-3 server is ~1.5 GB of processes: the colocated reference starts with the
# cluster (peak: three servers) and serves once the cluster has served every prompt.
@pytest.fixture(scope="module")
def colocated_spawned(model_path, request):
    return spawn_colocated(model_path, "gemma3", NO_RADIX, MAX_TOTAL_TOKENS, request)


@pytest.fixture(scope="module")
def pd_runs(model_path, colocated_spawned, request) -> dict:
    """Every prompt through one 1P1D cluster: output ids, wire records, and each side's KV
    usage once the requests are done."""
    def usage(state: dict, out: dict) -> None:
        out["usage"] = {role: _idle_usage(_url(state, role)) for role in ("prefill", "decode")}

    return cluster_runs(_pd_spec(model_path), _prompts(model_path), N_NEW, request, before_down=usage)


@pytest.fixture(scope="module")
def colocated_runs(model_path, pd_runs, colocated_spawned) -> dict:
    """The same prompts through one colocated HACK server with the cluster's server flags."""
    return colocated_runs_of(colocated_spawned, _prompts(model_path), N_NEW, STARTUP_TIMEOUT_S)


def _prompt(model_path: str, n: int, index: int) -> list[int]:
    from hack_eval.workloads import essay_ids

    return essay_ids(model_path, n, index=index)


def _url(state: dict, role: str) -> str:
    return next(s["url"] for s in state["servers"] if s["role"] == role)


def _kv_usage(url: str) -> dict:
    return requests.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]["hack_kv"]


def _predicted_wire_bytes(model_path: str, n: int, full_pages: bool = False) -> int:
    """Every layer's full pages as `hack` sends them (--hack-kv-codec hack-pages: without K's
    code sums, no open page), its FP16 open partition and its FP16 sinks (disagg.pd_state);
    full_pages: every page as stored (hack-full-pages). Each layer in its own layout: the
    servers' default `--hack-bits auto` loads Gemma-3's shipped bit plan (hack_ops/plans/), whose
    layers hold K and V at their own bits, so the bytes on the wire are the plan's."""
    import json

    from hack_ops import HackConfig
    from hack_ops.bit_plan import SHIPPED_DIR, find_plan
    from hack_ops.page_wire import model_request_bytes

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    found = find_plan(model_path)
    assert found is not None and found[1].parent == SHIPPED_DIR, found
    return model_request_bytes(found[0].apply(HackConfig()), cfg["num_hidden_layers"],
                               cfg["num_key_value_heads"], cfg["head_dim"], n, hack_pages=not full_pages)


def _idle_usage(url: str) -> dict:
    deadline = time.monotonic() + 60  # prefill frees a request once decode acknowledged it
    usage = _kv_usage(url)
    while (usage["request_rows_in_use"] or usage["used_tokens"]) and time.monotonic() < deadline:
        time.sleep(1.0)
        usage = _kv_usage(url)
    return usage


def test_pd_gives_the_colocated_greedy_tokens_past_the_window(pd_runs, colocated_runs, model_path):
    for i, n in enumerate(PROMPT_LENGTHS):
        assert len(_prompt(model_path, n, index=i)) == n > WINDOW
    assert_same_greedy_tokens(pd_runs, colocated_runs, PROMPT_LENGTHS, N_NEW)


def test_every_page_tail_and_sink_crossed_the_wire(pd_runs, model_path):
    for n in PROMPT_LENGTHS:
        sent = checked_wire_bytes(pd_runs, n, _predicted_wire_bytes(model_path, n), WIRE_TOLERANCE)
        assert sent < _predicted_wire_bytes(model_path, n, full_pages=True)


def test_both_sides_free_the_requests(pd_runs):
    for role, usage in pd_runs["usage"].items():
        assert usage["request_rows_in_use"] == 0 and usage["used_tokens"] == 0, (role, usage)
