"""The accuracy study's fast attention paths (hack_eval/attention_paths.py) against the dense
reference hack_ops.attention, on inputs the FP16 cache holds exactly (the serving store behind
the 'hack' path quantizes FP16 values, the reference float32 ones).

Tolerances: 'exact' and 'dequant' compute the same float expression in a different order
(blocked softmax, split P·V): 1e-4 absolute on outputs of magnitude ~1. 'hack' runs the serving
extend kernel, held to the reference by tests/test_cpu_extend_kernel.py with the bounds argued
in tests/test_paged_attention.py (an INT8 code of Q' or P' may flip with a different summation
order): every row within FLIP_TOL and 90% of rows within ROUNDOFF_TOL, the same bounds here.
"""
from __future__ import annotations

import pytest
import torch

from hack_eval.attention_paths import AttentionPath, dequant_views, fast_refusal, study_attention
from hack_ops import HackConfig, attention
from hack_ops.paged import cpu_extend
from hack_ops.rotation import restore_output, rotate_qkv
from test_paged_attention import FLIP_TOL, ROUNDOFF_TOL

DENSE_TOL = 1e-4


def _qkv(n: int, hq: int, h: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    chan = torch.rand(d, generator=g) * 3 + 0.2  # uneven channel ranges, as real K has
    q = torch.randn(1, hq, n, d, generator=g).half().float()
    k = (torch.randn(1, h, n, d, generator=g) * chan).half().float()
    v = torch.randn(1, h, n, d, generator=g).half().float()
    return q, k, v


def _ref(q, k, v, cfg, mode, **kw):
    return attention(q, k, v, cfg, mode=mode, causal=True, **kw)


CASES = [
    # (n, hq, h, d, config, features)
    (300, 6, 2, 64, HackConfig(), {}),
    (200, 4, 1, 256, HackConfig(), {"window": 70, "scale": 256 ** -0.5}),
    (260, 4, 2, 64, HackConfig(partition_size=32, sink_tokens=4), {"window": 45, "logit_cap": 5.0}),
    (190, 4, 2, 64, HackConfig(kv_bits=4), {}),
    (210, 4, 2, 64, HackConfig(k_bits=4), {}),  # K at 4 bits, V at 2
    (170, 2, 1, 128, HackConfig(kv_bits=4, k_bits=2), {"window": 90}),
    (256, 4, 2, 64, HackConfig(rotation="hadamard_kv"), {}),
    (150, 2, 2, 64, HackConfig(range_search=False, sink_tokens=0), {}),
]
IDS = ["gqa", "d256-window", "p32-sinks4-window-cap", "4bit", "k4-v2", "k2-v4-window", "rotation", "minmax-nosink"]


@pytest.mark.parametrize("n,hq,h,d,cfg,feat", CASES, ids=IDS)
def test_exact_and_dequant_match_reference(n, hq, h, d, cfg, feat):
    q, k, v = _qkv(n, hq, h, d, seed=n + d)
    for mode, c in (("exact", None), ("dequant", cfg)):
        fast = study_attention(q, k, v, c, mode, path=AttentionPath.FAST, **feat)
        ref = _ref(q, k, v, c, mode, **feat)
        assert fast.shape == ref.shape
        assert (fast - ref).abs().max().item() < DENSE_TOL, mode


@pytest.mark.parametrize("cfg", [HackConfig(orientation="token_k", tail_tensors="per_channel", sink_tokens=0),
                                 HackConfig(tail_tensors="per_channel"),
                                 HackConfig(orientation="token_k", sink_tokens=1)],
                         ids=["paper-layout", "k-tail-only", "paper-with-tails"])
def test_dequant_layouts_match_reference(cfg):
    """Tensors quantized as written (no tail) are read from their codes in the open partition too."""
    q, k, v = _qkv(230, 4, 2, 64, seed=7)
    fast = study_attention(q, k, v, cfg, "dequant", window=100)
    assert (fast - _ref(q, k, v, cfg, "dequant", window=100)).abs().max().item() < DENSE_TOL


@pytest.mark.parametrize("n,hq,h,d,cfg,feat", CASES[:7], ids=IDS[:7])
def test_hack_runs_the_serving_extend(n, hq, h, d, cfg, feat):
    path, why = cpu_extend.choose(_store(cfg, h, d), "hack", window=feat.get("window"))
    if path not in cpu_extend.TILED:
        pytest.skip(f"the tiled extend kernel does not run here: {why}")
    q, k, v = _qkv(n, hq, h, d, seed=n + d + 1)
    fast = study_attention(q, k, v, cfg, "hack", **feat)
    # The serving store quantizes FP16 K and V: after a rotation that is the rotated values
    # rounded, so the reference gets those (unrotated config, output rotated back).
    qr, kr, vr = rotate_qkv(q, k, v, cfg.rotation)
    ref = restore_output(_ref(qr, kr.half().float(), vr.half().float(), cfg.replace(rotation="none"), "hack",
                              **feat), cfg.rotation)
    err = (fast - ref).abs().amax(-1).flatten()  # per (head, query) row
    assert err.max().item() < FLIP_TOL
    assert (err < ROUNDOFF_TOL).float().mean().item() >= 0.9


def _store(cfg, h, d):
    from hack_ops.paged.store import HackKVStore

    return HackKVStore(cfg, 1, h, d, num_pages=4, num_rows=1)


def test_views_follow_the_cache():
    """Sinks read FP16 in both views; a per-channel page that has not filled has no codes."""
    cfg = HackConfig(sink_tokens=2)
    _, k, v = _qkv(100, 2, 2, 64, seed=3)
    kc, ko, vc, vo = dequant_views(k, v, cfg)
    assert torch.equal(kc[..., :2, :], k[..., :2, :]) and torch.equal(vc[..., :2, :], v[..., :2, :])
    assert torch.equal(ko, k) and torch.equal(vo, v)  # both tensors have FP16 tails
    assert not torch.equal(kc[..., 2:64, :], k[..., 2:64, :])  # the first page closed: codes
    assert torch.equal(kc[..., 64:, :], torch.zeros_like(kc[..., 64:, :]))  # 36 tokens: open page


def test_refused_configs_run_on_the_reference():
    cfg = HackConfig(k_outlier_channels=1)
    assert "reference only" in fast_refusal(cfg, "dequant")
    assert "RQE" in fast_refusal(HackConfig(requant_elimination=False), "hack")
    assert fast_refusal(HackConfig(), "hack") is None and fast_refusal(None, "exact") is None
    q, k, v = _qkv(130, 2, 1, 64, seed=5)
    out = study_attention(q, k, v, cfg, "dequant")
    assert torch.equal(out, _ref(q, k, v, cfg, "dequant"))


def test_bad_arguments():
    q, k, v = _qkv(20, 2, 1, 64, seed=1)
    with pytest.raises(ValueError, match="attention path"):
        study_attention(q, k, v, None, "exact", path="gpu")
    with pytest.raises(ValueError, match="one sequence"):
        study_attention(q.expand(2, -1, -1, -1), k, v, None, "exact")


def test_generation_steps_run_on_the_reference():
    """A step with fewer queries than keys (transformers' cache during generate) is the
    reference's bottom-right case."""
    q, k, v = _qkv(140, 4, 2, 64, seed=2)
    out = study_attention(q[:, :, -3:], k, v, HackConfig(), "hack")
    assert torch.equal(out, _ref(q[:, :, -3:], k, v, HackConfig(), "hack"))


def test_cli_offers_every_path():
    from hack_cli.cmd_eval import ATTENTION_PATHS

    assert set(ATTENTION_PATHS) == {p.value for p in AttentionPath}


def test_rows_record_where_they_ran():
    from hack_eval.runner import EXACT, Variant, row_path

    fast = AttentionPath.FAST
    assert row_path(EXACT, fast) == fast
    assert row_path(Variant("d", "dequant", HackConfig(k_outlier_channels=2)), fast) == AttentionPath.REFERENCE
    # A per-layer config reaches the attention as one uniform config per layer: fast.
    assert row_path(Variant("e", "hack", HackConfig(edge_layer_bits=4)), fast) == fast
    assert row_path(Variant("d", "dequant", HackConfig()), AttentionPath.REFERENCE) == AttentionPath.REFERENCE
