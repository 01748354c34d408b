"""The options the accuracy study measured first in the dense reference: dense-and-sparse K
(k_outlier_channels: the reference only, refused by the paged store and at server startup), more
bits for the first and last layer (edge_layer_bits) and for chosen layers (four_bit_layers: per
layer, served; tests/test_layer_bits.py covers the paged paths).
Each is checked against a dense computation, in the layout's bytes and in the study's runner."""
from __future__ import annotations

import types

import pytest
import torch

from hack_ops import HackConfig, attention
from hack_ops.layout import bytes_per_token, model_bytes_per_token, page_layout
from hack_ops.quant import widest_channels

P = 32


def test_config_fields_validate_and_name_themselves():
    c = HackConfig(k_outlier_channels=2, edge_layer_bits=4)
    assert c.label() == "channel_k-P64-2bit-sink1-kout2-edge4bit"
    assert c.reference_only() == ("k_outlier_channels",)
    assert HackConfig().reference_only() == () and HackConfig(edge_layer_bits=2).reference_only() == ()
    assert HackConfig(edge_layer_bits=2).label() == HackConfig().label()  # 2 = kv_bits: the default layout
    for bad in (-1, 33, True, 1.5):
        with pytest.raises(ValueError, match="k_outlier_channels"):
            HackConfig(k_outlier_channels=bad)
    with pytest.raises(ValueError, match="channel_k"):
        HackConfig(orientation="token_k", k_outlier_channels=1)
    for bad in (1, 3, 8, True):
        with pytest.raises(ValueError, match="edge_layer_bits"):
            HackConfig(edge_layer_bits=bad)


def test_for_layer_gives_the_edges_their_bits():
    c = HackConfig(edge_layer_bits=4)
    assert [c.for_layer(i, 5).kv_bits for i in range(5)] == [4, 2, 2, 2, 4]
    assert all(not c.for_layer(i, 5).per_layer for i in range(5))
    assert HackConfig().for_layer(0, 1) == HackConfig()
    for layer, n in ((5, 5), (-1, 5), (0, 0)):
        with pytest.raises(ValueError, match="layer"):
            c.for_layer(layer, n)


def test_four_bit_layers_validate_resolve_and_name_themselves():
    c = HackConfig(four_bit_layers=[5, 1, 5])
    assert c.four_bit_layers == (1, 5) and c.per_layer
    assert c.label() == "channel_k-P64-2bit-sink1-L1,5-4bit"
    assert c.reference_only() == ()  # served: each layer's pages are laid out with its bits
    assert [c.for_layer(i, 7).kv_bits for i in range(7)] == [2, 4, 2, 2, 2, 4, 2]
    assert all(not c.for_layer(i, 7).per_layer for i in range(7))
    both = HackConfig(edge_layer_bits=4, four_bit_layers=(2,))
    assert [both.for_layer(i, 5).kv_bits for i in range(5)] == [4, 2, 4, 2, 4]
    assert both._per_layer_fields() == ("edge_layer_bits", "four_bit_layers")
    assert HackConfig(edge_layer_bits=2, four_bit_layers=(2,))._per_layer_fields() == ("four_bit_layers",)
    # every layer at 4 bits already: one layout, nothing per layer
    assert not HackConfig(kv_bits=4, four_bit_layers=(1,)).per_layer
    with pytest.raises(ValueError, match=r"four_bit_layers \[7\] are beyond the model's 7 layers"):
        HackConfig(four_bit_layers=(1, 7)).for_layer(0, 7)
    for bad in ((-1,), (True,), (1.0,), "1,5", 3):
        with pytest.raises(ValueError, match="four_bit_layers"):
            HackConfig(four_bit_layers=bad)
    two = bytes_per_token(page_layout(HackConfig(), 1, 256), 2048)["bytes_per_token"]
    four = bytes_per_token(page_layout(HackConfig(kv_bits=4), 1, 256), 2048)["bytes_per_token"]
    got = model_bytes_per_token(c, 18, 1, 256, 2048)["bytes_per_token"]
    assert got == pytest.approx((16 * two + 2 * four) / 18)


def test_widest_channels_picks_the_widest_range_per_group_under_the_mask():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 2 * P, 8, generator=g)  # ranges < 1
    x[0, :P, 5] *= 9  # widest in head 0, page 0
    x[0, :P, 2] *= 4
    x[1, P:, 7] *= 9  # widest in head 1, page 1
    mask = torch.ones_like(x, dtype=torch.bool)
    got = widest_channels(x, 2, P, mask)
    assert got.shape == (2, 2, 8) and bool((got.sum(-1) == 2).all())
    assert got[0, 0].nonzero().flatten().tolist() == [2, 5]
    assert bool(got[1, 1, 7])
    # Masked elements take no part: hide channel 5's tokens, it is no longer the widest.
    mask[0, :P, 5] = False
    assert not bool(widest_channels(x, 1, P, mask)[0, 0, 5])
    # Equal ranges: the lower channel index wins (a deterministic choice).
    flat = torch.zeros(1, P, 4)
    assert widest_channels(flat, 2, P)[0, 0].tolist() == [True, True, False, False]
    for n in (-1, 8):
        with pytest.raises(ValueError, match="n must be"):
            widest_channels(x, n, P)
    with pytest.raises(ValueError, match="group_size"):
        widest_channels(x, 1, 48)


def _grid_kv(seq: int, d: int, outliers: list[int], seed: int = 0):
    """K whose channels outside `outliers` sit exactly on a 2-bit grid of every page (levels 0..3
    times 1/4, each level present), with wide arbitrary outlier channels; V on a 2-bit grid per
    token. 2-bit quantization stores such K and V exactly except the outlier channels."""
    g = torch.Generator().manual_seed(seed)
    lv = torch.randint(0, 4, (1, 1, seq, d), generator=g).float()
    lv[..., :4, :] = torch.arange(4.0)[:, None]  # sinks aside, every page holds every level:
    for p0 in range(0, seq, P):
        lv[..., p0 + 1 : p0 + 5, :] = torch.arange(4.0)[:, None]
    k = lv * 0.25
    k[..., outliers] = torch.randn(1, 1, seq, len(outliers), generator=g) * 40
    vl = torch.randint(0, 4, (1, 1, seq, d), generator=g).float()
    vl[..., :4] = torch.arange(4.0)
    v = vl * 0.5 - 0.75
    return k.half().float(), v.half().float()


@pytest.mark.parametrize("n", [1, 3])
def test_dense_and_sparse_k_matches_a_dense_computation(n):
    """Channels outside the n outliers are exact on the 2-bit grid, so with n outlier channels
    kept in FP16 the dequantized cache IS the dense FP16 cache: 'dequant' equals exact attention;
    with fewer outlier channels than outliers it does not."""
    seq, d = 5 * P + 7, 16
    outs = [3, 9, 12][:n]
    k, v = _grid_kv(seq, d, outs)
    q = torch.randn(1, 2, seq, d, generator=torch.Generator().manual_seed(1))
    exact = attention(q, k, v, None, "exact")
    cfg = HackConfig(partition_size=P, k_outlier_channels=n)
    deq = attention(q, k, v, cfg, "dequant")
    torch.testing.assert_close(deq, exact, atol=2e-5, rtol=1e-5)
    hack = attention(q, k, v, cfg, "hack")
    # The homomorphic path adds INT8 Q/P noise only; the outliers' scale (0) is out of Q's range.
    assert (hack - exact).abs().max().item() < 0.05
    fewer = attention(q, k, v, cfg.replace(k_outlier_channels=n - 1), "dequant")
    assert (fewer - exact).abs().max().item() > 20 * (deq - exact).abs().max().item() + 1e-3


def test_dense_and_sparse_k_cuts_the_error_on_an_outlier_channel():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 4 * P + 5, 32, generator=g) for h in (4, 2, 2))
    k[..., 7] = k[..., 7] * 15 + 10
    q[..., 7] *= 3
    exact = attention(q, k, v, None, "exact")
    base = HackConfig(partition_size=P)
    for mode in ("dequant", "hack"):
        e0 = (attention(q, k, v, base, mode) - exact).pow(2).mean()
        e1 = (attention(q, k, v, base.replace(k_outlier_channels=1), mode) - exact).pow(2).mean()
        assert e1 < 0.5 * e0, (mode, e0, e1)


def test_outlier_sections_are_counted_in_the_page_bytes():
    base = page_layout(HackConfig(), 3, 64)
    lay = page_layout(HackConfig(k_outlier_channels=2), 3, 64)
    assert lay.v == base.v and base.k.outlier_index is None
    assert lay.k.outlier_index.shape == (3, 2) and lay.k.outlier_index.dtype == torch.uint8
    assert lay.k.outlier_values.shape == (3, 64, 2) and lay.k.outlier_values.dtype == torch.float16
    assert lay.k.outlier_values.offset >= lay.k.outlier_index.offset + 3 * 2
    extra = 3 * 2 + 3 * 64 * 2 * 2
    assert extra <= lay.k.page_bytes - base.k.page_bytes < extra + 32  # two sections, 16-byte aligned
    assert lay.describe()["k_outlier_channels"] == 2 and "k_outlier_channels" not in base.describe()
    assert bytes_per_token(lay, 2048)["ratio"] > bytes_per_token(base, 2048)["ratio"]
    with pytest.raises(ValueError, match="below head_dim"):
        page_layout(HackConfig(partition_size=16, k_outlier_channels=16), 1, 16)


def test_edge_layer_bits_bytes_average_over_the_layers():
    c = HackConfig(edge_layer_bits=4)
    with pytest.raises(ValueError, match="per layer"):
        page_layout(c, 3, 64)
    two = bytes_per_token(page_layout(HackConfig(), 3, 64), 2048)["bytes_per_token"]
    four = bytes_per_token(page_layout(HackConfig(kv_bits=4), 3, 64), 2048)["bytes_per_token"]
    got = model_bytes_per_token(c, 30, 3, 64, 2048)["bytes_per_token"]
    assert got == pytest.approx((28 * two + 2 * four) / 30)
    assert model_bytes_per_token(HackConfig(), 30, 3, 64, 2048)["bytes_per_token"] == pytest.approx(two)


def test_per_layer_config_needs_resolving_and_the_runner_resolves_it():
    from hack_eval import runner

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 2 * P + 3, 64, generator=g) for h in (2, 1, 1))
    cfg = HackConfig(partition_size=P, edge_layer_bits=4)
    with pytest.raises(ValueError, match="for_layer"):
        attention(q, k, v, cfg, "dequant")
    variant = runner.Variant("edges", "dequant", cfg)
    for layer, bits in ((0, 4), (1, 2), (3, 4)):
        module = types.SimpleNamespace(layer_idx=layer, config=types.SimpleNamespace(num_hidden_layers=4))
        with runner.use_variant(variant, "reference"):  # bit for bit: the reference on both sides
            got, _ = runner._attention_fn(module, q, k, v, None)
        want = attention(q, k, v, cfg.replace(kv_bits=bits, edge_layer_bits=0), "dequant").transpose(1, 2)
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_the_paged_store_refuses_reference_only_options():
    from hack_ops.paged.store import HackKVStore

    with pytest.raises(ValueError, match="reference"):
        HackKVStore(HackConfig(partition_size=P, k_outlier_channels=1), num_layers=1, num_heads=1, head_dim=64,
                    num_pages=4, num_rows=1)
