"""hack_ops.attention against an independent, deliberately simple reference.

The reference below is written from the documented semantics only (the docstrings of
hack_ops.attention, HackConfig and hack_ops.layout), not from the implementation: for every
query position t it builds, explicitly, the cache a server holds after token t, then runs one
decode step in float64.

  * Cache after token t (tokens 0..t): the first `sink_tokens` tokens keep FP16 K and V and take
    no part in any range. Page p (tokens pΠ..pΠ+Π-1) is closed when all of its tokens are
    present; a closed page is quantized with hack_ops.quantize over its non-sink tokens: the
    per-channel tensor (K for channel_k, V for token_k) per channel over those tokens, the
    per-token tensor per token in head_dim groups of min(Π, D). The open partition is FP16 for
    the tensors with a tail (config.k_tail / config.v_tail); a per-token tensor without a tail
    is quantized as each token arrives. With requant_elimination off the open partition is
    quantized at every step over the (non-sink) tokens it holds.
  * Decode step, 'dequant': exact attention over the dequantized cache (and FP16 tail/sinks).
  * Decode step, 'hack': scores of quantized keys from INT8 Q (token_k: Q per head_dim group;
    channel_k: Q' = Q ⊙ s_K(page), per page and head_dim group, plus Q · m_K exactly), the
    numerator P = exp(S - max S), and values from INT8 P with a zero minimum (channel_k:
    P' = P ⊙ s_V(token) per page and head_dim group, plus Σ P m_V exactly; token_k: P per page).
    The INT8 operands and the 2-bit codes are dequantized and multiplied in float64, which is
    mathematically the homomorphic formula (Eq. 4).

Tolerances. Q and Q' are formed and INT8-quantized in float32 exactly as a kernel does (an
element-wise product, min/max, one division): the codes are identical to the implementation's,
so those steps contribute no difference. Everything downstream is float64 here and float32
there: a difference of float32 round-off, bounded by ROUNDOFF_ATOL = 2e-5 on these unit-scale
outputs (measured: below 6e-6). The one place where float32 round-off can turn into a
discrete change is the INT8 rounding of P (P comes out of the softmax's float32 arithmetic):
a P' value v (in code units) within max(TIE_ABS, TIE_REL * v) of a rounding boundary may
round to the neighbouring code (float32 scores carry ~1e-5 relative error, from the
cancellation between sq * Σ Qq Kq and mq * Σ Kq; measured flips all sit within 1e-4). The
reference marks those values and adds their largest possible effect (one code step times the
V value it multiplies, over the softmax denominator) to the bound of the affected output
elements. Almost all output rows have no such value; their bound is ROUNDOFF_ATOL alone. For
scale, 2-bit quantization moves these outputs by ~0.1-0.5.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from hack_ops import HackConfig, attention, quantize


pytestmark = pytest.mark.usefixtures("one_torch_thread")


ROUNDOFF_ATOL = 2e-5
TIE_ABS, TIE_REL = 1e-4, 1e-5  # P' ties: within max(TIE_ABS, TIE_REL * v) codes of a boundary


# ------------------------------------------------------------------------------------------
# The reference
# ------------------------------------------------------------------------------------------

@dataclass
class Block:
    """Quantized tokens of one tensor that share a page: `idx` are absolute token positions."""

    page: int
    idx: list[int]
    codes: torch.Tensor  # [H, n, D] float64 (integer values)
    scale: torch.Tensor  # [H, n, D] float64, broadcast to the elements
    minimum: torch.Tensor  # [H, n, D] float64
    per_token_scale: torch.Tensor | None  # [H, n, ng] (per-token tensors only)
    per_token_min: torch.Tensor | None

    @property
    def deq(self) -> torch.Tensor:
        return self.codes * self.scale + self.minimum


def _quantize_block(x: torch.Tensor, idx: list[int], page: int, per_channel: bool, cfg: HackConfig) -> Block:
    """x: [H, S, D] float32. Quantize tokens `idx` the documented way."""
    d = x.shape[-1]
    gd = min(cfg.partition_size, d)
    meta = torch.float16 if cfg.meta_dtype == "float16" else torch.float32
    xs = x[:, idx]  # [H, n, D]
    if per_channel:  # one group per channel over these tokens
        qt = quantize(xs, cfg.kv_bits, dim=1, group_size=len(idx), meta_dtype=meta,
                      range_search=cfg.range_search)
        s = qt.scale.double().expand(xs.shape)
        m = qt.minimum.double().expand(xs.shape)
        return Block(page, idx, qt.codes.double(), s, m, None, None)
    qt = quantize(xs, cfg.kv_bits, dim=2, group_size=gd, meta_dtype=meta,
                  range_search=cfg.range_search)  # [H, n, ng]
    s = qt.scale.double().repeat_interleave(gd, dim=2)
    m = qt.minimum.double().repeat_interleave(gd, dim=2)
    return Block(page, idx, qt.codes.double(), s, m, qt.scale.double(), qt.minimum.double())


def cache_after(x: torch.Tensor, t: int, cfg: HackConfig, per_channel: bool, has_tail: bool,
                memo: dict | None = None):
    """What the server holds for one tensor (K or V, [H, S, D]) after token t: the FP16 token
    positions (sinks and tail) and the quantized blocks. `memo` (one per tensor and sequence)
    keeps the blocks already quantized at an earlier t: the same tokens quantize to the same
    block (nearest rounding), so a closed page is quantized once, not once per query."""
    p, sinks = cfg.partition_size, cfg.sink_tokens
    memo = {} if memo is None else memo

    def block(idx: list[int], page: int, per_ch: bool) -> Block:
        key = (tuple(idx), page, per_ch)
        if key not in memo:
            memo[key] = _quantize_block(x, idx, page, per_ch, cfg)
        return memo[key]

    n = t + 1
    closed = n // p
    fp16 = list(range(min(sinks, n)))
    blocks: list[Block] = []
    if per_channel:
        for page in range(closed):
            idx = [j for j in range(page * p, page * p + p) if j >= sinks]
            if idx:
                blocks.append(block(idx, page, True))
        open_idx = [j for j in range(closed * p, n) if j >= sinks]
        if cfg.requant_elimination:
            fp16 += open_idx
        elif open_idx:  # RQE off: the open partition re-quantized over what it holds now
            blocks.append(block(open_idx, closed, True))
    else:
        tail = has_tail and cfg.requant_elimination
        last_quantized = closed * p if tail else n
        for page in range(-(-last_quantized // p)):
            idx = [j for j in range(page * p, min(page * p + p, last_quantized)) if j >= sinks]
            if idx:  # each token quantized on its own (groups along head_dim)
                blocks.append(block(idx, page, False))
        if tail:
            fp16 += [j for j in range(closed * p, n) if j >= sinks]
    return sorted(fp16), blocks


def int8_asym_f32(x: torch.Tensor, group: int) -> torch.Tensor:
    """INT8 asymmetric min/max quantization of float32 x per `group` elements of the last dim,
    done in float32 as a kernel does it; returns the dequantized values in float64."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    mn = g.amin(-1, keepdim=True)
    s = (g.amax(-1, keepdim=True) - mn) / 255
    s = torch.where(s <= 0, torch.ones_like(s), s)
    c = torch.round((g - mn) / s).clamp(0, 255)
    return (c.double() * s.double() + mn.double()).reshape(x.shape)


def int8_zero_min(x: torch.Tensor, dim: int):
    """INT8 with a zero minimum over `dim` of float64 x >= 0. Returns dequantized values, the
    step per group, and a mask of values that sit so close to a rounding boundary (see TIE_ABS,
    TIE_REL) that float32 round-off upstream could round them the other way."""
    mx = x.amax(dim, keepdim=True)
    s = torch.where(mx > 0, mx / 255, torch.ones_like(mx))
    v = x / s
    c = torch.round(v)
    tie = ((v - torch.floor(v)) - 0.5).abs() < torch.clamp(TIE_REL * v, min=TIE_ABS)
    return c * s, s, tie


def reference_step(qt32: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: int, cfg: HackConfig, mode: str,
                   memo: tuple[dict, dict] | None = None):
    """One decode step for queries qt32 [Hq, D] (float32, already multiplied by the softmax
    scale) at position t over k, v [Hkv, S, D] (float32). Returns (out, bound) [Hq, D] float64:
    `bound` is the largest change that P' rounding ties could cause (0 for 'dequant').
    `memo`: K's and V's quantized blocks of earlier steps over the same k, v (cache_after)."""
    hq, d = qt32.shape
    rep = hq // k.shape[0]
    gd = min(cfg.partition_size, d)
    k_memo, v_memo = memo if memo is not None else ({}, {})
    k_fp16, k_blocks = cache_after(k, t, cfg, per_channel=not cfg.k_per_token, has_tail=cfg.k_tail, memo=k_memo)
    v_fp16, v_blocks = cache_after(v, t, cfg, per_channel=not cfg.v_per_token, has_tail=cfg.v_tail, memo=v_memo)

    def heads(x):  # kv heads -> query heads (query head h reads kv head h // rep)
        return x.repeat_interleave(rep, dim=0)

    qs = qt32.double()
    s = torch.full((hq, t + 1), float("nan"), dtype=torch.float64)
    if k_fp16:
        s[:, k_fp16] = torch.einsum("hd,hjd->hj", qs, heads(k[:, k_fp16].half().double()))
    q_int8 = int8_asym_f32(qt32, gd) if (mode == "hack" and cfg.k_per_token) else None
    for blk in k_blocks:
        if mode == "dequant":
            s[:, blk.idx] = torch.einsum("hd,hjd->hj", qs, heads(blk.deq))
        elif cfg.k_per_token:  # Eq. 4: INT8 Q times per-token 2-bit K
            s[:, blk.idx] = torch.einsum("hd,hjd->hj", q_int8, heads(blk.deq))
        else:  # Q' = Q ⊙ s_K (per page), INT8; plus Q · m_K exactly
            sk = heads(blk.scale[:, 0].float())  # [Hq, D] (the same for all tokens of the page)
            q_fold = int8_asym_f32(qt32 * sk, gd)
            s[:, blk.idx] = (torch.einsum("hd,hjd->hj", q_fold, heads(blk.codes))
                             + (qs * heads(blk.minimum[:, 0])).sum(-1, keepdim=True))
    assert not bool(s.isnan().any()), "every visible key must be FP16 or in a quantized block"
    pr = torch.exp(s - s.amax(-1, keepdim=True))
    denom = pr.sum(-1, keepdim=True)
    out = torch.zeros(hq, d, dtype=torch.float64)
    bound = torch.zeros(hq, d, dtype=torch.float64)
    if v_fp16:
        out += torch.einsum("hj,hjd->hd", pr[:, v_fp16], heads(v[:, v_fp16].half().double()))
    for blk in v_blocks:
        pj = pr[:, blk.idx]  # [Hq, n]
        if mode == "dequant":
            out += torch.einsum("hj,hjd->hd", pj, heads(blk.deq))
        elif cfg.v_per_token:  # P' = P ⊙ s_V(token), INT8 per (page, head_dim group)
            sv = heads(blk.per_token_scale)  # [Hq, n, ng]
            pf = pj.unsqueeze(-1) * sv
            pq, step, tie = int8_zero_min(pf, dim=1)
            codes = heads(blk.codes)  # [Hq, n, D]
            out += torch.einsum("hjd,hjd->hd", pq.repeat_interleave(gd, -1), codes)
            out += torch.einsum("hj,hjd->hd", pj, heads(blk.minimum))
            bound += torch.einsum("hjd,hjd->hd", (tie * step).repeat_interleave(gd, -1), codes)
        else:  # P per page, INT8; V per channel
            pq, step, tie = int8_zero_min(pj, dim=1)
            vd = heads(blk.deq)
            out += torch.einsum("hj,hjd->hd", pq, vd)
            bound += torch.einsum("hj,hjd->hd", tie * step, vd.abs())
    return out / denom, bound / denom


def reference_attention(q, k, v, cfg: HackConfig, mode: str, causal: bool = True, scale=None):
    """Dense [B, H, S, D] inputs, queries at the last len(q) positions (or all at the last
    position when not causal). Returns (out, bound) as float64 [B, Hq, Sq, D]."""
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qs32 = q.float() * scale
    out = torch.zeros(b, hq, sq, d, dtype=torch.float64)
    bound = torch.zeros_like(out)
    for bi in range(b):
        kb, vb, memo = k[bi].float(), v[bi].float(), ({}, {})
        for i in range(sq):
            t = sk - sq + i if causal else sk - 1
            o, e = reference_step(qs32[bi, :, i], kb, vb, t, cfg, mode, memo)
            out[bi, :, i], bound[bi, :, i] = o, e
    return out, bound


# ------------------------------------------------------------------------------------------
# Data and comparison
# ------------------------------------------------------------------------------------------

def make_qkv(b, hkv, rep, sq, sk, d, seed):
    """Random normal q, k, v with per-channel K offsets (so per-channel and per-token ranges
    differ), rounded to FP16-representable values so that 'the FP16 tail' is exactly the input."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * rep, sq, d, generator=g)
    k = torch.randn(b, hkv, sk, d, generator=g) + 1.5 * torch.randn(1, hkv, 1, d, generator=g)
    v = torch.randn(b, hkv, sk, d, generator=g) * 0.8 + 0.3
    return q.half().float(), k.half().float(), v.half().float()


def assert_close_to_reference(got, ref, bound, what):
    got = got.double()
    err = (got - ref).abs()
    allowed = ROUNDOFF_ATOL + bound
    bad = err > allowed
    if bool(bad.any()):
        excess = err - allowed
        at = tuple(int(i) for i in torch.unravel_index(excess.argmax(), err.shape))
        raise AssertionError(f"{what}: {int(bad.sum())} of {err.numel()} elements outside the bound; "
                             f"worst excess {float(excess.max()):.3g} at [b, h, q, d] = {at}, "
                             f"got {float(got[at]):.6f}, reference {float(ref[at]):.6f}")
    # The tie margin must stay rare, or the comparison would say little. With a handful of rows
    # (decode shapes: 8 rows) a couple of rows is already a large fraction, so two are allowed.
    tie_rows = int((bound.amax(-1) > 0).sum())
    rows = bound[..., 0].numel()
    assert tie_rows <= 2 or tie_rows < 0.25 * rows, f"{what}: {tie_rows} of {rows} rows have P' ties (margin too wide)"
    return err


# ------------------------------------------------------------------------------------------
# hack_ops.attention('hack' / 'dequant') against the reference
# ------------------------------------------------------------------------------------------

# (sink_tokens, Π, kv_bits, GQA factor, head_dim, batch)
VARIANTS = [
    (0, 16, 2, 1, 16, 1),
    (1, 32, 2, 3, 64, 1),
    (4, 16, 4, 3, 32, 1),
    (1, 16, 2, 1, 64, 2),
    (4, 32, 4, 1, 16, 1),
]
LAYOUTS = [(o, t, r) for o in ("channel_k", "token_k") for t in ("kv", "per_channel") for r in (True, False)]
CASES = [
    pytest.param(HackConfig(partition_size=p, kv_bits=bits, orientation=o, tail_tensors=t,
                            requant_elimination=r, sink_tokens=s), rep, d, b,
                 id=f"{o}-{t}-{'rqe' if r else 'noRQE'}-sink{s}-P{p}-{bits}bit-gqa{rep}-D{d}-B{b}")
    for o, t, r in LAYOUTS for s, p, bits, rep, d, b in VARIANTS
]


def _seq_len(p: int) -> int:
    """Long enough that the queries see every tail length 0..Π-1 both before and after the
    first page closes, plus a third, partial page."""
    n = 2 * p + p // 2 + 1
    assert {(t + 1) % p for t in range(p, n)} == set(range(p))
    return n


@pytest.mark.parametrize("mode", ["hack", "dequant"])
@pytest.mark.parametrize("cfg,rep,d,b", CASES)
def test_matches_reference(cfg, rep, d, b, mode):
    n = _seq_len(cfg.partition_size)
    q, k, v = make_qkv(b, 2, rep, n, n, d, seed=cfg.partition_size + d + cfg.sink_tokens + rep)
    ref, bound = reference_attention(q, k, v, cfg, mode)
    got = attention(q, k, v, cfg, mode=mode)
    assert got.dtype == torch.float32 and got.shape == q.shape
    if mode == "dequant":
        assert not bool(bound.any())
    assert_close_to_reference(got, ref, bound, f"{cfg.label()} {mode}")
    # The quantization is visible (the comparison is not between two exact attentions).
    exact = attention(q, k, v, mode="exact").double()
    assert float((ref - exact).abs().max()) > 1e-2


@pytest.mark.parametrize("mode", ["hack", "dequant"])
@pytest.mark.parametrize("cfg", [
    HackConfig(partition_size=16, sink_tokens=4),
    HackConfig(partition_size=16, orientation="token_k", sink_tokens=0),
    HackConfig(partition_size=32, tail_tensors="per_channel", requant_elimination=False),
], ids=lambda c: c.label())
@pytest.mark.parametrize("sq,causal", [(1, True), (7, True), (3, False)])
def test_matches_reference_partial_queries(cfg, sq, causal, mode):
    """Queries at the last len(q) positions (decode and chunked prefill), and non-causal
    queries, which all see the whole cache as it is after the last token."""
    n = 2 * cfg.partition_size + 9
    q, k, v = make_qkv(2, 2, 2, sq, n, 32, seed=sq + n)
    ref, bound = reference_attention(q, k, v, cfg, mode, causal=causal)
    got = attention(q, k, v, cfg, mode=mode, causal=causal)
    assert_close_to_reference(got, ref, bound, f"{cfg.label()} {mode} sq={sq} causal={causal}")


def test_matches_reference_custom_scale_and_half_inputs():
    cfg = HackConfig(partition_size=16, sink_tokens=1)
    q, k, v = make_qkv(1, 2, 2, 40, 40, 32, seed=21)
    qb = q.bfloat16().float()
    for mode in ("hack", "dequant"):
        ref, bound = reference_attention(q, k, v, cfg, mode, scale=0.3)
        got = attention(q.half(), k.half(), v.half(), cfg, mode=mode, scale=0.3)
        assert_close_to_reference(got, ref, bound, f"fp16 inputs {mode}")
        ref, bound = reference_attention(qb, k, v, cfg, mode, scale=0.3)
        got = attention(q.bfloat16(), k, v, cfg, mode=mode, scale=0.3)
        assert_close_to_reference(got, ref, bound, f"bf16 q {mode}")


BASE = HackConfig(partition_size=16, sink_tokens=1)


@pytest.mark.parametrize("wrong", [
    dict(sink_tokens=0), dict(sink_tokens=4), dict(requant_elimination=False),
    dict(tail_tensors="per_channel"), dict(orientation="token_k"), dict(partition_size=32),
    dict(kv_bits=4), dict(meta_dtype="float32"), dict(range_search=False),
], ids=lambda w: ",".join(f"{k}={v}" for k, v in w.items()))
def test_comparison_detects_other_semantics(wrong):
    """The comparison has power: the implementation run with BASE does not pass against the
    reference of a configuration that differs in any single choice (sinks, RQE, tails,
    orientation, page size, bits, metadata precision)."""
    q, k, v = make_qkv(1, 2, 2, 41, 41, 32, seed=23)
    got = attention(q, k, v, BASE, mode="hack")
    assert_close_to_reference(got, *reference_attention(q, k, v, BASE, "hack"), "BASE")
    ref, bound = reference_attention(q, k, v, BASE.replace(**wrong), "hack")
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_close_to_reference(got, ref, bound, "wrong semantics")


def test_comparison_detects_an_off_by_one_page_closure(monkeypatch):
    """A cache in which a page counts as closed one token early (quantized over the tokens it
    has) is caught too."""
    q, k, v = make_qkv(1, 2, 2, 41, 41, 32, seed=24)
    got = attention(q, k, v, BASE, mode="hack")
    original = cache_after

    def early(x, t, cfg, per_channel, has_tail, memo=None):
        if per_channel and (t + 2) % cfg.partition_size == 0:  # one token short of closing
            return original(x, t, cfg.replace(requant_elimination=False), per_channel, has_tail, memo)
        return original(x, t, cfg, per_channel, has_tail, memo)

    monkeypatch.setattr(sys.modules[__name__], "cache_after", early)
    ref, bound = reference_attention(q, k, v, BASE, "hack")
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_close_to_reference(got, ref, bound, "early closure")


# ------------------------------------------------------------------------------------------
# attention: exact mode, properties, error sizes, error paths
# ------------------------------------------------------------------------------------------

def _bottom_right_mask(sq, sk):
    return torch.arange(sk)[None, :] <= torch.arange(sk - sq, sk)[:, None]


@pytest.mark.parametrize("b,hkv,rep,sq,sk,d", [(2, 3, 1, 37, 37, 64), (1, 2, 3, 37, 37, 32),
                                               (2, 1, 4, 5, 29, 16), (1, 3, 3, 1, 50, 64)])
@pytest.mark.parametrize("causal", [True, False])
def test_exact_matches_sdpa(b, hkv, rep, sq, sk, d, causal):
    q, k, v = make_qkv(b, hkv, rep, sq, sk, d, seed=b + hkv + rep + sq + sk + d)
    got = attention(q, k, v, mode="exact", causal=causal)
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # query head h -> kv head h // rep
    mask = _bottom_right_mask(sq, sk) if causal else None
    ref = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    assert got.dtype == torch.float32
    assert torch.allclose(got, ref, atol=2e-6, rtol=0), float((got - ref).abs().max())
    if rep > 1:
        gqa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert torch.allclose(got, gqa, atol=2e-6, rtol=0)
    if sq == sk and causal:
        assert torch.allclose(got, F.scaled_dot_product_attention(q, kk, vv, is_causal=True), atol=2e-6, rtol=0)


def test_exact_scale_and_input_dtypes():
    q, k, v = make_qkv(1, 2, 1, 20, 20, 32, seed=3)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.05)
    assert torch.allclose(attention(q, k, v, scale=0.05), ref, atol=2e-6, rtol=0)
    half = attention(q.half(), k.half(), v.half())
    assert half.dtype == torch.float32  # computed in float32 whatever the input dtype
    assert torch.allclose(half, attention(q, k, v), atol=1e-6, rtol=0)  # inputs are fp16-exact


@pytest.mark.parametrize("mode", ["exact", "hack", "dequant"])
@pytest.mark.parametrize("orientation", ["channel_k", "token_k"])
def test_gqa_equals_repeated_kv_heads(mode, orientation):
    """Query head h reads KV head h // rep; quantization is per KV head, so repeating the KV
    heads gives the same result."""
    cfg = HackConfig(partition_size=16, orientation=orientation, sink_tokens=1)
    q, k, v = make_qkv(2, 2, 3, 45, 45, 32, seed=4)
    gqa = attention(q, k, v, cfg, mode=mode)
    full = attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), cfg, mode=mode)
    assert torch.allclose(gqa, full, atol=1e-6, rtol=0)
    wrong = attention(q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1), cfg, mode=mode)  # h -> h % 2
    assert not torch.allclose(gqa, wrong, atol=1e-2)


@pytest.mark.parametrize("cfg", [HackConfig(partition_size=16), HackConfig(partition_size=32, sink_tokens=4),
                                 HackConfig(partition_size=16, orientation="token_k", requant_elimination=False)],
                         ids=lambda c: c.label())
def test_decode_step_equals_teacher_forced_row_at_every_tail_length(cfg):
    """A single query at position n-1 over the first n tokens sees exactly what row n-1 of the
    teacher-forced pass sees, for every tail length 0..Π-1 (n from Π to 2Π)."""
    p = cfg.partition_size
    q, k, v = make_qkv(1, 2, 2, 2 * p + 1, 2 * p + 1, 32, seed=p)
    full = attention(q, k, v, cfg, mode="hack")
    _, bound = reference_attention(q, k, v, cfg, "hack")
    seen = set()
    for n in range(p, 2 * p + 1):
        step = attention(q[:, :, n - 1 : n], k[:, :, :n], v[:, :, :n], cfg, mode="hack")
        err = (step[:, :, 0] - full[:, :, n - 1]).abs().double()
        assert bool((err <= 2 * ROUNDOFF_ATOL + 2 * bound[:, :, n - 1]).all()), (n, float(err.max()))
        seen.add(n % p)
    assert seen == set(range(p))


def test_short_sequence_is_exact_with_fp16_tails():
    """Before the first page closes, everything is in the FP16 tail (K and V), so 'hack' and
    'dequant' equal exact attention; with V quantized as written ('per_channel' tails for
    channel_k) they do not."""
    q, k, v = make_qkv(1, 2, 2, 31, 31, 32, seed=6)
    exact = attention(q, k, v, mode="exact")
    cfg = HackConfig(partition_size=32)
    for mode in ("hack", "dequant"):
        assert torch.allclose(attention(q, k, v, cfg, mode=mode), exact, atol=2e-6, rtol=0)
        per_channel = attention(q, k, v, cfg.replace(tail_tensors="per_channel"), mode=mode)
        assert float((per_channel - exact).abs().max()) > 1e-2


@pytest.mark.parametrize("cfg,max_rel", [
    (HackConfig(), 0.22), (HackConfig(kv_bits=4), 0.04), (HackConfig(partition_size=32), 0.22),
    (HackConfig(orientation="token_k"), 0.35), (HackConfig(orientation="token_k", kv_bits=4), 0.06),
    (HackConfig(requant_elimination=False), 0.33), (HackConfig(tail_tensors="per_channel"), 0.3),
], ids=lambda x: x.label() if isinstance(x, HackConfig) else str(x))
def test_hack_error_bounded_and_close_to_dequant(cfg, max_rel):
    """SmolLM2-like shape (3 KV heads, GQA 3, D = 64), 256 tokens of random data. Relative
    Frobenius errors against exact attention (measured: 2-bit 0.17-0.28, 4-bit 0.03-0.045).
    The INT8 Q/P noise, ||hack - dequant|| / ||exact||, is below 0.01 (measured 0.002-0.007),
    so 'hack' is never worse than 'dequant' by more than that."""
    q, k, v = make_qkv(1, 3, 3, 256, 256, 64, seed=5)
    exact = attention(q, k, v, mode="exact").double()
    hack = attention(q, k, v, cfg, mode="hack").double()
    deq = attention(q, k, v, cfg, mode="dequant").double()
    norm = float(exact.norm())
    rel_hack = float((hack - exact).norm()) / norm
    rel_deq = float((deq - exact).norm()) / norm
    int8_noise = float((hack - deq).norm()) / norm
    assert rel_hack < max_rel
    assert int8_noise < 0.01
    assert rel_hack <= rel_deq + 0.01
    assert int8_noise < 0.3 * rel_deq  # INT8 noise is small next to the KV quantization error


def test_more_bits_and_sinks_help():
    q, k, v = make_qkv(1, 3, 3, 256, 256, 64, seed=7)
    k[:, :, 0] += 6.0  # an outlier first token: a sink keeps it out of page 0's ranges
    exact = attention(q, k, v, mode="exact")

    def err(c):
        return float((attention(q, k, v, c, mode="hack") - exact).norm())
    assert err(HackConfig(kv_bits=4)) < 0.3 * err(HackConfig())
    assert err(HackConfig(sink_tokens=1)) < err(HackConfig(sink_tokens=0))


@pytest.mark.parametrize("orientation", ["channel_k", "token_k"])
def test_summation_elimination_does_not_change_attention(orientation):
    q, k, v = make_qkv(1, 2, 2, 50, 50, 32, seed=8)
    on = HackConfig(partition_size=16, orientation=orientation)
    off = on.replace(summation_elimination=False)
    assert torch.equal(attention(q, k, v, on, mode="hack"), attention(q, k, v, off, mode="hack"))


def test_stochastic_rounding_reproducible_and_comparable():
    cfg = HackConfig(partition_size=16, rounding="stochastic")
    q, k, v = make_qkv(1, 2, 2, 50, 50, 32, seed=9)
    a = attention(q, k, v, cfg, mode="hack", generator=torch.Generator().manual_seed(1))
    b = attention(q, k, v, cfg, mode="hack", generator=torch.Generator().manual_seed(1))
    c = attention(q, k, v, cfg, mode="hack", generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    exact = attention(q, k, v, mode="exact")
    nearest = attention(q, k, v, cfg.replace(rounding="nearest"), mode="hack")
    e_st, e_nr = float((a - exact).norm()), float((nearest - exact).norm())
    assert 0.5 * e_nr < e_st < 2.5 * e_nr  # stochastic rounding: same order, somewhat noisier


def test_default_config_and_mode():
    q, k, v = make_qkv(1, 2, 1, 70, 70, 64, seed=10)
    assert torch.equal(attention(q, k, v), attention(q, k, v, mode="exact"))
    assert torch.equal(attention(q, k, v, mode="hack"), attention(q, k, v, HackConfig(), mode="hack"))


@pytest.mark.parametrize("bad,match", [
    (dict(mode="fast"), "mode"),
    (dict(q=torch.randn(2, 8, 16)), "4-D"),
    (dict(k=torch.randn(1, 2, 8)), "4-D"),
    (dict(q=torch.ones(1, 2, 8, 16, dtype=torch.int32)), "floating point"),
    (dict(v=torch.ones(1, 2, 8, 16, dtype=torch.int64)), "floating point"),
    (dict(v=torch.randn(1, 2, 9, 16)), "k and v shapes differ"),
    (dict(q=torch.randn(2, 2, 8, 16)), "batch or head_dim"),
    (dict(q=torch.randn(1, 2, 8, 32)), "batch or head_dim"),
    (dict(q=torch.randn(1, 3, 8, 16)), "multiple of kv heads"),
    (dict(k=torch.randn(1, 2, 0, 16), v=torch.randn(1, 2, 0, 16)), "at least one token"),
    (dict(q=torch.randn(1, 2, 9, 16)), "len\\(q\\) <= len\\(k\\)"),
])
@pytest.mark.parametrize("mode", ["exact", "hack"])
def test_invalid_inputs_raise(bad, match, mode):
    args = dict(q=torch.randn(1, 2, 8, 16), k=torch.randn(1, 2, 8, 16), v=torch.randn(1, 2, 8, 16), mode=mode)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        attention(args.pop("q"), args.pop("k"), args.pop("v"), HackConfig(partition_size=16), **args)


@pytest.mark.parametrize("orientation,mode", [
    ("channel_k", "hack"),
    ("channel_k", "dequant"),
    ("token_k", "hack"),
    ("token_k", "dequant"),
])
def test_head_dim_not_divisible_by_group_raises(orientation, mode):
    q, k, v = make_qkv(1, 1, 1, 8, 8, 48, seed=11)
    with pytest.raises(ValueError, match="group_size|head_dim"):
        attention(q, k, v, HackConfig(partition_size=32, orientation=orientation), mode=mode)


# ---- NaN behaviour ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["hack", "dequant"])
@pytest.mark.parametrize("orientation", ["channel_k", "token_k"])
@pytest.mark.parametrize("which", ["k", "v"])
def test_nan_in_a_quantized_token_raises(mode, orientation, which):
    """Documented in hack_ops.quant: non-finite values are rejected when they are quantized."""
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16, seed=12)
    {"k": k, "v": v}[which][0, 0, 5, 3] = float("nan")  # page 0, closed from token 15 on
    with pytest.raises(ValueError, match="NaN"):
        attention(q, k, v, HackConfig(partition_size=16, orientation=orientation), mode=mode)


@pytest.mark.parametrize("mode", ["exact", "hack", "dequant"])
def test_nan_in_a_query_poisons_only_its_row(mode):
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16, seed=13)
    cfg = HackConfig(partition_size=16)
    clean = attention(q, k, v, cfg, mode=mode)
    q[0, 1, 20, 7] = float("nan")
    got = attention(q, k, v, cfg, mode=mode)
    nan_rows = got.isnan().any(-1)
    assert nan_rows[0, 1, 20] and int(nan_rows.sum()) == 1
    keep = ~nan_rows.unsqueeze(-1).expand_as(got)
    assert torch.allclose(got[keep], clean[keep], atol=1e-6, rtol=0)


def test_exact_nan_in_key_follows_causality():
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16, seed=14)
    k[0, 0, 25, 3] = float("nan")
    got = attention(q, k, v, mode="exact")
    nan_rows = got.isnan().any(-1)[0]
    assert not bool(nan_rows[0, :25].any()) and bool(nan_rows[0, 25:].all())
    assert not bool(nan_rows[1].any())
