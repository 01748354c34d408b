"""Static eviction through prefill/decode disaggregation: `hack up --static-keep 0.5` (SmolLM2,
both servers with `--hack-static-keep 0.5`) gives the colocated server's greedy tokens with the
same flags, and each layer sends only the prompt pages it keeps.

Why equality is the bar: the prefill server decides the kept sets exactly as the colocated one
does (same prefill, same queries), they travel in the request's state, and the decode server
reads the same pages; a set lost on the way (decode reading every page, the unsent ones
holding stale bytes) or a page a layer kept left off the wire changes the scores and, greedy,
the tokens. Every server runs with --disable-radix-cache. One cluster and one colocated server,
started together, always stopped.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pd_compare import assert_same_greedy_tokens, cluster_runs, essay_prompts, spawn_colocated
from pd_compare import colocated_runs as colocated_runs_of

pytestmark = [pytest.mark.memory_heavy, pytest.mark.integration, pytest.mark.slow, pytest.mark.e2e]

KEEP = 0.5
NO_RADIX = ["--disable-radix-cache"]
MAX_TOTAL_TOKENS = 8192
PROMPT_LENGTHS = (157, 1500)  # 2 and 23 closed pages, an FP16 open partition after them
N_NEW = 8
STATE_SLACK = 4096  # bytes not in the prediction: the metadata row (~1 KB), the kept set's rows (~0.7 KB)
STARTUP_TIMEOUT_S = 900.0


@pytest.fixture(scope="module")
def model_path() -> str:
    from hack_eval.models import prepare

    return str(prepare("smollm2", log=lambda *a, **k: None))


@pytest.fixture(scope="module")
def colocated_spawned(model_path, request):
    return spawn_colocated(model_path, "static-keep", ["--hack-static-keep", str(KEEP), *NO_RADIX],
                           MAX_TOTAL_TOKENS, request)


@pytest.fixture(scope="module")
def pd_runs(model_path, colocated_spawned, request) -> dict:
    from hack_cli.cmd_cluster import spec_from_args
    from hack_cli.main import build_parser

    args = build_parser().parse_args(["up", "--model", "smollm2", "--kv", "hack", "--static-keep", str(KEEP),
                                      "--max-total-tokens", str(MAX_TOTAL_TOKENS)])
    spec = spec_from_args(args)
    assert spec.extra_server_args == ["--hack-static-keep", str(KEEP)]
    spec.extra_server_args += NO_RADIX
    spec.health_timeout_s = STARTUP_TIMEOUT_S
    return cluster_runs(spec, essay_prompts(model_path, PROMPT_LENGTHS), N_NEW, request)


@pytest.fixture(scope="module")
def colocated_runs(model_path, pd_runs, colocated_spawned) -> dict:
    return colocated_runs_of(colocated_spawned, essay_prompts(model_path, PROMPT_LENGTHS), N_NEW, STARTUP_TIMEOUT_S)


def test_pd_with_static_eviction_gives_the_colocated_greedy_tokens(pd_runs, colocated_runs):
    assert_same_greedy_tokens(pd_runs, colocated_runs, PROMPT_LENGTHS, N_NEW)


def test_each_layer_sends_only_the_pages_it_keeps(pd_runs, model_path):
    """Every layer keeps ceil(0.5 x closed pages) of the prompt (the first page among them; the
    observation window's own page is the open one at these lengths): its bytes lie between those
    pages each sent as a run of its own and all of them in one run, plus the open partition and
    sinks; well under what every page costs."""
    from hack_ops import HackConfig
    from hack_ops.bit_plan import find_plan
    from hack_ops.layout import page_layout
    from hack_ops.page_wire import _state_bytes, derived_bytes, request_bytes, wire_page_bytes
    from hack_ops.static_keep import StaticKeep

    cfg_json = json.loads((Path(model_path) / "config.json").read_text())
    layers, heads = cfg_json["num_hidden_layers"], cfg_json["num_key_value_heads"]
    head_dim = cfg_json["hidden_size"] // cfg_json["num_attention_heads"]
    config = find_plan(model_path)[0].apply(HackConfig())  # the default server's calibrated bits
    for n in PROMPT_LENGTHS:
        recs = pd_runs["wire"][n]
        assert len(recs) == 1
        sent = recs[0]["bytes"]
        closed = n // 64
        kept = StaticKeep(keep=KEEP).kept_count(closed)
        low = high = full = 0
        for i in range(layers):
            lay = page_layout(config.for_layer(i, layers), heads, head_dim)
            low += kept * wire_page_bytes(lay) + _state_bytes(lay, n)
            high += kept * lay.page_bytes - derived_bytes(lay.k) - derived_bytes(lay.v) + _state_bytes(lay, n)
            full += request_bytes(lay, 1, n)
        print(f"\n{n}-token prompt: {sent} B sent, kept-page bounds {low}..{high}, every page {full}")
        assert low <= sent <= high + STATE_SLACK, (n, sent, low, high)
        assert sent < full, (n, sent, full)
        assert kept == math.ceil(KEEP * closed)
