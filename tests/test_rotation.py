"""hack_ops.rotation and HackConfig.rotation: the Walsh-Hadamard rotation is orthogonal, exact
attention does not see it (windows, soft-caps and scaling included), the quantized paths compute
on the rotated values, and the format carries it (label, layout fingerprint, head_dim refusal).

Tolerances: float32 products of unit-norm rows, so identities hold to ~1e-6 (ROUNDOFF = 1e-5
leaves room for sums over 64 channels); quantized outputs are compared only to each other
(same arithmetic) or by their error to the exact output."""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig, attention
from hack_ops.layout import page_layout
from hack_ops.rotation import Rotation, fwht, head_dim_refusal, restore_output, rotate_qkv, rotation_matrix

ROUNDOFF = 1e-5
ROTATIONS = [r for r in Rotation if r != Rotation.NONE]


def _qkv(seed=0, n=150, hq=6, h=2, d=64, outlier=None):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, n, d, generator=g) for heads in (hq, h, h))
    if outlier is not None:  # one channel far larger than the rest, as real K and V have
        k[..., outlier] *= 12.0
        v[..., outlier] *= 12.0
    return q, k, v


@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.parametrize("signed", [False, True])
def test_rotation_is_orthogonal_and_fwht_agrees(d, signed):
    r = rotation_matrix(d, signed)
    assert r.dtype == torch.float32 and r.shape == (d, d)
    assert torch.allclose(r @ r.T, torch.eye(d), atol=ROUNDOFF)
    x = torch.randn(7, 3, d, generator=torch.Generator().manual_seed(d))
    assert torch.allclose(fwht(x, signed), x @ r, atol=ROUNDOFF)
    # fixed seeded signs: the same matrix every time (both PD sides derive it alone)
    assert torch.equal(rotation_matrix(d, signed), r)
    if signed:
        assert not torch.equal(r, rotation_matrix(d, False)) and torch.equal(r.abs(), rotation_matrix(d, False).abs())


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("signed", [False, True])
def test_bf16_rotation_is_the_float32_product_rounded_once(d, signed):
    """BF16 q/k/v rotate by one BF16 GEMM where BF16 holds R exactly (D a power of four); the
    result is the float32 product rounded to BF16 (bit for bit on these draws); at D = 128
    (1/sqrt(128) is no BF16 number) the float32 path runs."""
    from hack_ops.rotation import _exact_bf16

    from hack_ops.rotation import BF16_GEMM_MIN

    g = torch.Generator().manual_seed(d + signed)
    x = torch.randn(512, 3, d, generator=g).to(torch.bfloat16)
    assert x.numel() >= BF16_GEMM_MIN  # the GEMM path (a decode step's few rows take the float32 one)
    rot = Rotation.SIGNED_HADAMARD_KV if signed else Rotation.HADAMARD_KV
    r = rotation_matrix(d, signed)
    q, _, _ = rotate_qkv(x, x, x, rot)
    assert q.dtype == torch.bfloat16
    assert (_exact_bf16(d, signed, "cpu") is None) == (d == 128)
    want = (x.float() @ r).to(torch.bfloat16)
    assert (q != want).float().mean() <= 1e-5  # a tie rounded apart by the summation order, at most
    back = restore_output(q, rot)
    assert torch.allclose(back.float(), x.float(), atol=0.05, rtol=0.02)


def test_scopes_rotate_the_right_tensors():
    q, k, v = (t[0].transpose(0, 1) for t in _qkv(n=5))  # [tokens, heads, D], as the backend has them
    for rot in Rotation:
        q2, k2, v2 = rotate_qkv(q, k, v, rot)
        assert torch.equal(q2, q) != rot.rotates_k and torch.equal(k2, k) != rot.rotates_k
        assert torch.equal(v2, v) != rot.rotates_v
        assert torch.allclose(restore_output(v2, rot), v, atol=ROUNDOFF)
    bf = q.bfloat16()
    assert rotate_qkv(bf, bf, bf, Rotation.HADAMARD_KV)[0].dtype == torch.bfloat16  # callers keep their dtype


@pytest.mark.parametrize("rot", ROTATIONS)
@pytest.mark.parametrize("feat", [dict(), dict(window=40, logit_cap=5.0, scale=0.3)])
def test_exact_attention_is_unchanged_by_the_rotation(rot, feat):
    """Rotated Q/K/V with the output rotated back equals plain attention; the rotation is
    orthogonal, so sliding windows, soft-caps and the layer's scaling are unaffected."""
    q, k, v = _qkv()
    plain = attention(q, k, v, None, mode="exact", **feat)
    rotated = attention(q, k, v, HackConfig(rotation=rot), mode="exact", **feat)
    assert (rotated - plain).abs().max().item() < ROUNDOFF


@pytest.mark.parametrize("rot", [Rotation.HADAMARD_V, Rotation.SIGNED_HADAMARD_KV])
def test_quantized_modes_compute_on_the_rotated_values(rot):
    cfg = HackConfig(rotation=rot, range_search=False)
    q, k, v = _qkv(seed=1)
    exact = attention(q, k, v, None, mode="exact")
    qr, kr, vr = rotate_qkv(q, k, v, rot)
    for mode in ("hack", "dequant"):
        got = attention(q, k, v, cfg, mode=mode)
        # the reference is the unrotated format applied to rotated inputs, output rotated back
        by_hand = restore_output(attention(qr, kr, vr, cfg.replace(rotation="none"), mode=mode), rot)
        assert (got - by_hand).abs().max().item() < ROUNDOFF
        assert (got - attention(q, k, v, cfg.replace(rotation="none"), mode=mode)).abs().max().item() > 1e-2
    # hack vs dequant on the same rotated layout: only the INT8 Q/P noise, far below 2-bit error
    hack = attention(q, k, v, cfg, mode="hack")
    deq = attention(q, k, v, cfg, mode="dequant")
    assert (hack - deq).pow(2).mean() < 0.1 * (deq - exact).pow(2).mean()


def test_v_rotation_flattens_an_outlier_channel():
    """Why the option exists: per-token V groups are ranged by their largest channel; the
    rotation spreads an outlier over all channels, so 2-bit V loses less."""
    q, k, v = _qkv(seed=2, outlier=5)
    exact = attention(q, k, v, None, mode="exact")
    err = {r: (attention(q, k, v, HackConfig(rotation=r, range_search=False), mode="dequant") - exact).pow(2).mean()
           for r in (Rotation.NONE, Rotation.HADAMARD_V)}
    assert err[Rotation.HADAMARD_V] < 0.7 * err[Rotation.NONE], err


def test_config_label_layout_and_head_dim():
    cfg = HackConfig(rotation="signed_hadamard_kv")
    assert cfg.rotation is Rotation.SIGNED_HADAMARD_KV and cfg.label().endswith("-rot-signed_hadamard_kv")
    assert HackConfig().rotation is Rotation.NONE and "rot" not in HackConfig().label()
    with pytest.raises(ValueError, match="rotation must be one of"):
        HackConfig(rotation="givens")
    base = page_layout(HackConfig(), 3, 64).describe()
    rot = page_layout(cfg, 3, 64).describe()
    assert base["rotation"] == "none" and rot["rotation"] == "signed_hadamard_kv" and rot != base
    assert page_layout(cfg, 3, 64).page_bytes == page_layout(HackConfig(), 3, 64).page_bytes  # no bytes
    p32 = HackConfig(partition_size=32)  # head_dim groups of 32 fit 96
    page_layout(p32, 1, 96)  # served without a rotation
    with pytest.raises(ValueError, match="needs a head_dim that is a power of two .* got head_dim 96"):
        page_layout(p32.replace(rotation="hadamard_v"), 1, 96)
    assert head_dim_refusal("none", 96) is None and head_dim_refusal("hadamard_k", 128) is None
    with pytest.raises(ValueError):
        attention(*_qkv(d=96, n=4), HackConfig(rotation="hadamard_v"), mode="exact")
