"""HCache's restore (hack_eval.hidden_restore) and `hack bench restore-sources` on the real models.

The restore runs a layer's own norm, projections, K norm and RoPE on the hidden state that entered
the layer, so in the model's dtype it must give the forward pass's K and V bit for bit, on every
layer of both shipped models (Gemma-3: K norm, two rotary embeddings for its two layer types). The
benchmark's three sources must leave the same pages in the pool, and a page file that changed is
refused by its digest."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from hack_cli import bench_restore
from hack_eval.hidden_restore import (cached_kv, capture_layer_inputs, decoder_layers, hidden_bytes_per_token,
                                      restore_layer_kv)
from hack_eval.models import prepare

TOKENS = 700  # past Gemma-3's 512-token window: its sliding layers' K/V are restored for every token too


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request):
    from transformers import AutoModelForCausalLM

    folder = prepare(request.param, log=lambda *a, **k: None)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa").eval()


def test_restored_kv_equals_the_forward_pass(model):
    ids = torch.randint(10, 5000, (TOKENS,), generator=torch.Generator().manual_seed(0))
    hidden, cache = capture_layer_inputs(model, ids)
    layers = decoder_layers(model)
    assert len(hidden) == len(layers) and hidden[0].shape == (TOKENS, model.config.hidden_size)
    for i in range(len(layers)):
        k, v = restore_layer_kv(model, i, hidden[i], torch.arange(TOKENS))
        kc, vc = cached_kv(cache, i)
        assert torch.equal(k, kc) and torch.equal(v, vc), f"layer {i}"
    # positions matter: the same hidden states at other positions give another K (RoPE), the same V
    k2, v2 = restore_layer_kv(model, 0, hidden[0], torch.arange(TOKENS) + 7)
    assert not torch.equal(k2, cached_kv(cache, 0)[0]) and torch.equal(v2, cached_kv(cache, 0)[1])
    # BF16 storage of a float32 model's hidden states: close, not equal
    kb, _ = restore_layer_kv(model, 1, hidden[1].to(torch.bfloat16).float(), torch.arange(TOKENS))
    err = (kb - cached_kv(cache, 1)[0]).abs().max()
    assert 0 < err < 0.05 * cached_kv(cache, 1)[0].abs().max()
    assert hidden_bytes_per_token(model) == len(layers) * model.config.hidden_size * 2


def test_models_without_decoder_layers_are_refused():
    with pytest.raises(ValueError, match="no model.layers"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_the_three_sources_leave_the_same_pages(tmp_path):
    r = bench_restore.measure("smollm2", 320, 1, tmp_path)
    src = r["sources"]
    assert all(s["pages_equal"] for s in src.values()), src
    assert src["hidden"]["bytes_per_token"] == r["layers"] * r["hidden_size"] * 2
    # HACK pages (a 4-bit plan, the open page's FP16 tail and the sinks included) stay under half of
    # BF16 KV even at 320 tokens; SmolLM2's hidden states are 1.5x its BF16 KV (576 vs 2 x 3 x 64)
    assert src["pages"]["bytes_per_token"] < 0.5 * r["bf16_kv_bytes_per_token"]
    assert src["hidden"]["bytes_per_token"] == 1.5 * r["bf16_kv_bytes_per_token"]
    assert set(src["pages"]) >= {"read_ms", "digest_ms", "copy_ms", "ms", "vs_recompute"}


def test_a_changed_page_file_is_refused():
    data = np.arange(1000, dtype=np.uint8)
    digest = bench_restore.page_digest(data)
    bench_restore.check_digest(data.copy(), digest)
    bad = data.copy()
    bad[500] ^= 1
    with pytest.raises(RuntimeError, match="do not match their digest"):
        bench_restore.check_digest(bad, digest)
    with pytest.raises(RuntimeError, match="do not match"):
        bench_restore.check_digest(data[:999], digest)  # truncated


def test_pool_load_refuses_the_wrong_size():
    from hack_ops import HackConfig

    pool = bench_restore.Pool(HackConfig(), 2, 1, 64, 100)
    flat = pool.request_bytes()
    pool.load(flat)
    with pytest.raises(ValueError, match="100-token request of this layout"):
        pool.load(flat + bytes(3))


def test_cli_refuses_bad_arguments(capsys):
    ns = argparse.Namespace(model="smollm2", tokens="12,x", runs=1, threads=0, out="")
    assert bench_restore.run_cli(ns) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert bench_restore.run_cli(argparse.Namespace(**{**vars(ns), "tokens": "32"})) == 2


def test_table_renders_every_source():
    doc = {"command": "hack bench restore-sources", "date": "2026-11-27", "cpu": "x", "amx": True, "threads": 2,
           "runs": 1, "results": [{"model": "smollm2", "tokens": 2048, "bf16_kv_bytes_per_token": 23040,
                                   "sources": {k: {"bytes_per_token": b, "ms": ms, "us_per_token": 1.0,
                                                   "vs_recompute": 2.0, "pages_equal": True}
                                               for k, b, ms in (("recompute", 0, 10.0), ("hidden", 34560, 5.0),
                                                                ("pages", 4608, 1.0))}}]}
    text = bench_restore.table(doc)
    assert "| smollm2 | 2048 | hidden | 34,560 | 150.0% |" in text and "| recompute | 0 | - |" in text
    json.dumps(doc)
