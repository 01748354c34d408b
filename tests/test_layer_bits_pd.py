"""Per-layer bits through prefill/decode disaggregation: `hack up --4bit-layers` (SmolLM2, its
retrieval-head layers at 4 bits, the rest at 2) gives the colocated server's greedy tokens with
the same flags, and the bytes on the wire are each layer's own pages (4-bit layers' wider ones)
in their wire form, its FP16 open partition and sinks.

Why equality is the bar: both sides lay out every layer with the same bits (the layer bits are
part of the PD layout fingerprint), so the only difference is the transfer; a page sent with
another layer's item size, or K sums rebuilt with another layer's layout, changes the scores and,
greedy, the tokens. Every server runs with --disable-radix-cache (cold prefill on both sides).
One cluster and one colocated server, started together, always stopped.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from pd_compare import assert_same_greedy_tokens, checked_wire_bytes, cluster_runs, essay_prompts, spawn_colocated
from pd_compare import colocated_runs as colocated_runs_of

pytestmark = [pytest.mark.memory_heavy, pytest.mark.integration, pytest.mark.slow, pytest.mark.e2e]

NO_RADIX = ["--disable-radix-cache"]
LAYERS = "7,14,15,17,18,20,21,23"  # SmolLM2's retrieval heads (docs/accuracy.md, "Retrieval")
MAX_TOTAL_TOKENS = 8192
PROMPT_LENGTHS = (157, 700)  # neither a multiple of the page size: an FP16 open partition travels
N_NEW = 8
WIRE_TOLERANCE = 0.01  # measured bytes vs the layout's prediction (the metadata row is ~1 KB)
STARTUP_TIMEOUT_S = 900.0


@pytest.fixture(scope="module")
def model_path() -> str:
    from hack_eval.models import prepare

    return str(prepare("smollm2", log=lambda *a, **k: None))


@pytest.fixture(scope="module")
def colocated_spawned(model_path, request):
    """The colocated reference, started with the cluster so that the two starts overlap."""
    return spawn_colocated(model_path, "layer-bits", ["--hack-4bit-layers", LAYERS, *NO_RADIX], MAX_TOTAL_TOKENS,
                           request)


@pytest.fixture(scope="module")
def pd_runs(model_path, colocated_spawned, request) -> dict:
    from hack_cli.cmd_cluster import spec_from_args
    from hack_cli.main import build_parser

    args = build_parser().parse_args(["up", "--model", "smollm2", "--kv", "hack", "--4bit-layers", LAYERS,
                                      "--max-total-tokens", str(MAX_TOTAL_TOKENS)])
    spec = spec_from_args(args)
    assert spec.extra_server_args == ["--hack-4bit-layers", LAYERS]
    spec.extra_server_args += NO_RADIX
    spec.health_timeout_s = STARTUP_TIMEOUT_S
    return cluster_runs(spec, essay_prompts(model_path, PROMPT_LENGTHS), N_NEW, request)


@pytest.fixture(scope="module")
def colocated_runs(model_path, pd_runs, colocated_spawned) -> dict:
    return colocated_runs_of(colocated_spawned, essay_prompts(model_path, PROMPT_LENGTHS), N_NEW, STARTUP_TIMEOUT_S)


def _predicted_wire_bytes(model_path: str, n: int) -> int:
    """Each layer's full pages in their wire form (its own bits), FP16 open partition and sinks."""
    import json

    from hack_ops import HackConfig
    from hack_ops.page_wire import model_request_bytes

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return model_request_bytes(HackConfig(four_bit_layers=tuple(int(x) for x in LAYERS.split(","))),
                               cfg["num_hidden_layers"], cfg["num_key_value_heads"],
                               cfg["hidden_size"] // cfg["num_attention_heads"], n)


def test_pd_with_4bit_layers_gives_the_colocated_greedy_tokens(pd_runs, colocated_runs):
    assert_same_greedy_tokens(pd_runs, colocated_runs, PROMPT_LENGTHS, N_NEW)


def test_each_layer_crossed_the_wire_with_its_own_page_size(pd_runs, model_path):
    from hack_ops import HackConfig
    from hack_ops.layout import page_layout
    from hack_ops.page_wire import request_bytes

    for n in PROMPT_LENGTHS:
        sent = checked_wire_bytes(pd_runs, n, _predicted_wire_bytes(model_path, n), WIRE_TOLERANCE)
        if n >= 2 * 64:  # two full pages or more: the 4-bit layers' pages make a visible difference
            uniform = request_bytes(page_layout(HackConfig(), 3, 64), 30, n)
            assert sent > uniform * (1 + 2 * WIRE_TOLERANCE), (sent, uniform)
