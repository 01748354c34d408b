"""K and V with their own bits (HackConfig.k_bits; raised_tensors 'k': the raised layers give K
alone 4 bits): the config, the layout's bytes, the reference against the study's fast paths,
a mixed store against uniform ones. The paged paths are held to the reference with split bits
where they are tested for every format (tests/test_paged_attention.py, test_paged_store.py,
test_cpu_store.py, test_cpu_extend_kernel.py, the Triton tests); the PD wire in
tests/test_hack_wire.py. The accuracy study measures it (docs/accuracy.md)."""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig, attention
from hack_ops.config import RaisedTensors
from hack_ops.layout import describe_layouts, model_bytes_per_token, page_layout


def test_k_bits_validate_and_default_to_kv_bits():
    assert HackConfig().bits("k") == HackConfig().bits("v") == 2
    c = HackConfig(k_bits=4)
    assert (c.bits("k"), c.bits("v")) == (4, 2) and c.label() == "channel_k-P64-K4V2bit-sink1"
    assert HackConfig(k_bits=2) == HackConfig()  # K as V: one spelling, the same config
    assert HackConfig(kv_bits=4, k_bits=2).bits("k") == 2
    for bad in (1, 3, 8, True):
        with pytest.raises(ValueError, match="k_bits"):
            HackConfig(k_bits=bad)
    with pytest.raises(ValueError, match="raised_tensors must be one of"):
        HackConfig(raised_tensors="q")
    with pytest.raises(ValueError, match="name must be 'k' or 'v'"):
        c.bits("q")


def test_raised_layers_give_k_alone_four_bits():
    c = HackConfig(four_bit_layers=(1, 3), raised_tensors="k")
    assert c.raised_tensors is RaisedTensors.K and c.per_layer and c.split_bits
    assert c.label() == "channel_k-P64-2bit-sink1-L1,3-4bit-raised-k"
    assert [(c.for_layer(i, 5).bits("k"), c.for_layer(i, 5).bits("v")) for i in range(5)] == [
        (2, 2), (4, 2), (2, 2), (4, 2), (2, 2)]
    assert c.for_layer(0, 5) == HackConfig() and c.for_layer(1, 5) == HackConfig(k_bits=4)
    v = HackConfig(four_bit_layers=(1,), raised_tensors="v")
    assert v.label() == "channel_k-P64-2bit-sink1-L1-4bit-raised-v" and v.split_bits
    assert v.for_layer(1, 3) == HackConfig(kv_bits=4, k_bits=2) and v.for_layer(0, 3) == HackConfig()
    assert not HackConfig(kv_bits=4, four_bit_layers=(1,), raised_tensors="v").per_layer  # V at 4 already
    edges = HackConfig(edge_layer_bits=4, raised_tensors="k")
    assert [edges.for_layer(i, 3).bits("k") for i in range(3)] == [4, 2, 4]
    assert [edges.for_layer(i, 3).bits("v") for i in range(3)] == [2, 2, 2]
    # K at 4 everywhere already: the raised layers change nothing, one layout
    assert not HackConfig(k_bits=4, four_bit_layers=(1,), raised_tensors="k").per_layer
    assert c.reference_only() == () and HackConfig(k_bits=4).reference_only() == ()  # served
    assert not HackConfig(raised_tensors="k").split_bits  # nothing raised: nothing split


def test_layout_counts_each_tensor_with_its_bits():
    h, d = 2, 128
    two, four, split = (page_layout(HackConfig(**kw), h, d) for kw in ({}, {"kv_bits": 4}, {"k_bits": 4}))
    assert split.k.page_bytes == four.k.page_bytes and split.v.page_bytes == two.v.page_bytes
    assert split.k.sums.dtype == four.k.sums.dtype  # code sums sized for K's 4-bit codes
    assert split.describe()["k_bits"] == 4 and "k_bits" not in two.describe()
    # Gemma-3-270M (18 layers, 1 KV head, head_dim 256), layers 5,11,17 raised, 4K context
    ratios = [model_bytes_per_token(HackConfig(four_bit_layers=(5, 11, 17), raised_tensors=t), 18, 1, 256,
                                    4096)["ratio"] for t in ("kv", "k")]
    base = model_bytes_per_token(HackConfig(), 18, 1, 256, 4096)["ratio"]
    assert base < ratios[1] < ratios[0]
    assert ratios[1] == pytest.approx(0.1804, abs=5e-4) and ratios[0] == pytest.approx(0.1909, abs=5e-4)


def test_store_description_lists_k_bits_per_layer():
    import types

    cfg = HackConfig(four_bit_layers=(1,), raised_tensors="k")
    store = types.SimpleNamespace(config=cfg, layouts=[page_layout(cfg.for_layer(i, 3), 1, 64) for i in range(3)])
    desc = describe_layouts(store)
    assert desc["layer_bits"] == [2, 2, 2] and desc["layer_k_bits"] == [2, 4, 2] and "k_bits" not in desc


def _qkv(seq: int, hq: int, hk: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, seq, d, generator=g) for h in (hq, hk, hk))
    k[..., 3] *= 8  # an outlier channel, as real K has
    return q, k, v


def test_dequant_views_quantize_each_tensor_with_its_bits():
    """The fast path's K views are the 4-bit config's, its V views the 2-bit config's, exactly."""
    from hack_eval.attention_paths import dequant_views

    _, k, v = _qkv(150, 2, 2, 64, seed=1)
    split = dequant_views(k, v, HackConfig(k_bits=4))
    four, two = dequant_views(k, v, HackConfig(kv_bits=4)), dequant_views(k, v, HackConfig())
    for got, want in zip(split, (*four[:2], *two[2:])):
        assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["dequant", "hack"])
def test_reference_error_lies_between_the_uniform_formats(mode):
    """K at 4 bits with V at 2 (the reference, both modes) is more accurate than 2 bits for both
    and less than 4 for both, on a GQA head layout with an outlier K channel."""
    q, k, v = _qkv(200, 4, 2, 64, seed=2)
    exact = attention(q, k, v, None, "exact")

    def err(cfg: HackConfig) -> float:
        return (attention(q, k, v, cfg, mode) - exact).pow(2).mean().item()

    e2, e42, e4 = err(HackConfig()), err(HackConfig(k_bits=4)), err(HackConfig(kv_bits=4))
    assert e4 < e42 < e2


def test_study_rows_with_split_bits_run_on_the_fast_paths():
    """Both modes (tests/test_eval_attention_paths.py holds them to the reference with split bits)."""
    from hack_eval.attention_paths import AttentionPath, fast_refusal
    from hack_eval.runner import Variant, row_path

    assert fast_refusal(HackConfig(k_bits=4), "hack") is None and fast_refusal(HackConfig(k_bits=4), "dequant") is None
    raised = HackConfig(four_bit_layers=(1,), raised_tensors="k")
    assert row_path(Variant("r", "hack", raised), AttentionPath.FAST) == AttentionPath.FAST


def test_a_layer_of_a_mixed_store_equals_a_uniform_store_of_its_bits():
    """Layers 1 and 3 with K at 4 bits and V at 2 in a 4-layer store: every byte and output of
    such a layer equals a one-layer store of HackConfig(k_bits=4) (tests/test_layer_bits.py's
    check, with raised_tensors 'k'), on the PyTorch paths and the compiled ones."""
    from test_layer_bits import LAYERS, MIXED, _need_compiled, _run

    from hack_ops.paged.store import StoreBackend

    mixed_cfg = MIXED.replace(raised_tensors="k")
    for store_backend, attn in ((StoreBackend.TORCH, "torch"), (StoreBackend.CPU, "cpu")):
        if attn == "cpu":
            _need_compiled()
        mixed, outs = _run(mixed_cfg, [0, 1], LAYERS, store_backend, attn)
        ref, ref_outs = _run(mixed_cfg.for_layer(1, LAYERS), [0], 1, store_backend, attn)
        assert (ref.config_for(0).bits("k"), ref.config_for(0).bits("v")) == (4, 2)
        for name in ("k_pages", "v_pages"):
            assert torch.equal(getattr(mixed, name)[1], getattr(ref, name)[0]), name
        for got, want in zip(outs[1], ref_outs[0]):
            assert torch.equal(got, want)
        # the K buffer is the 4-bit layout's, the V buffer the 2-bit one's
        assert mixed.k_pages[1].shape[1] > mixed.k_pages[0].shape[1]
        assert mixed.v_pages[1].shape == mixed.v_pages[0].shape


def test_study_rows_for_each_raised_set():
    from hack_eval.variants import layer_bits_variants

    rows = layer_bits_variants((5, 11), ["dequant"], ("kv", "k", "k", "v"))
    assert [r.name for r in rows] == ["default, layers 5,11 at 4 bits", "default, layers 5,11 K at 4 bits",
                                      "default, layers 5,11 V at 4 bits"]
    assert [r.config.raised_tensors for r in rows] == [RaisedTensors.KV, RaisedTensors.K, RaisedTensors.V]
    with pytest.raises(ValueError, match="raised_tensors must be one of"):
        layer_bits_variants((5,), None, ("q",))

