"""Tile-level Triton building blocks shared by the decode and prefill kernels.

Rows (M) are queries (prefill) or the query heads of one KV head (decode). Per-row head_dim
tensors are kept as [M, NG, Gd]: head_dim in NG groups of Gd = min(Π, D) channels (the groups
of INT8 Q and of per-token V).
Every matrix product is a 2-D tl.dot per group (a statically unrolled loop): Triton's batched
3-D dot puts its warps on the batch axis, which replicates the work when NG is small.
Semantics are hack_ops.attention's 'hack' mode with orientation 'channel_k' (K codes of K_BITS
bits, V codes of V_BITS: HackConfig.bits, they may differ):
  scores(page) = Σ_g sq (Qq · Kq) + mq ΣKq + Q · m_K   (Q' = Q ⊙ s_K(page) -> INT8 min/max)
  out(page)    = Σ_g sp (Pq · Vq) + Σ_j P_j m_V(j)      (P' = P ⊙ s_V(token) -> INT8, zero min)
INT8 codes (0..255) are shifted by -128 to fit a signed MMA; dot + 128·Σ(other operand's
codes) undoes it in int32, exactly (ΣKq is stored; ΣVq is summed from the codes in registers).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .jit_math import code_rows, int_dot, into_group, q8_along, q8_zero_min_along, v_codes_tile


@triton.jit
def softmax_step(s, m_i, l_i, acc):
    """Online-softmax update with a new score tile s [M, N] (-inf where masked).
    Returns the unnormalized probabilities p and the rescaled running state."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None, None]
    return p, m_new, l_i, acc


@triton.jit
def split_dot(a, b):
    """a (fp32) @ b (values exact in fp16) on fp16 tensor cores with fp32 accumulation: a is
    split into an fp16 head and an fp16 residual, so ~22 of its 24 bits survive (the FP16
    reference computes in fp32). Works wherever fp16 MMA does (sm70+) and in the interpreter."""
    hi = a.to(tl.float16)
    lo = (a - hi.to(tl.float32)).to(tl.float16)
    b16 = b.to(tl.float16)
    return tl.dot(hi, b16, out_dtype=tl.float32) + tl.dot(lo, b16, out_dtype=tl.float32)


@triton.jit
def _fp16_rows(base, tok_off, tok_ok, base2, tok2_off, tok2_ok, g, GD: tl.constexpr):
    """FP16 K or V of N tokens, head_dim group g, as fp32 [N, Gd]: token
    i at base + tok_off[i] where tok_ok, else at base2 + tok2_off[i] (rounded to fp16) where
    tok2_ok, else 0. Two sources: a request's FP16 tail and the new tokens of this step."""
    ch = g * GD + tl.arange(0, GD)[None, :]
    x = tl.load(base + tok_off[:, None] + ch, mask=tok_ok[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(base2 + tok2_off[:, None] + ch, mask=tok2_ok[:, None], other=0.0)
    return tl.where(tok_ok[:, None], x, x2.to(tl.float16).to(tl.float32))


@triton.jit
def load_q(q_base, row_off, row_ok, sm_scale, g, GD: tl.constexpr):
    """Scaled queries of head_dim group g, [M, Gd] fp32 (q * sm_scale, as the reference). Re-read
    per page from L1/L2 instead of held in registers across the page loop."""
    q = tl.load(q_base + row_off[:, None] + g * GD + tl.arange(0, GD)[None, :], mask=row_ok[:, None], other=0.0)
    return q.to(tl.float32) * sm_scale


@triton.jit
def fp16_scores(q_base, row_off, row_ok, sm_scale, k_base, tok_off, tok_ok, k2_base, tok2_off, tok2_ok,
                GD: tl.constexpr, NG: tl.constexpr):
    """Scores [M, N] of the rows' queries against the FP16 keys of N tokens (sources as in
    _fp16_rows)."""
    s = tl.zeros((row_off.shape[0], tok_off.shape[0]), tl.float32)
    for g in tl.static_range(NG):
        k = _fp16_rows(k_base, tok_off, tok_ok, k2_base, tok2_off, tok2_ok, g, GD)
        s += split_dot(load_q(q_base, row_off, row_ok, sm_scale, g, GD), tl.trans(k))
    return s


@triton.jit
def fp16_pv(p, v_base, tok_off, tok_ok, v2_base, tok2_off, tok2_ok,
            GD: tl.constexpr, NG: tl.constexpr):
    """P·V [M, NG, Gd] with FP16 values (sources as in _fp16_rows), in fp32."""
    out = tl.zeros((p.shape[0], NG, GD), tl.float32)
    for g in tl.static_range(NG):
        v = _fp16_rows(v_base, tok_off, tok_ok, v2_base, tok2_off, tok2_ok, g, GD)
        out += into_group(split_dot(p, v), g, NG)
    return out


@triton.jit
def quant_scores(q_base, row_off, row_ok, sm_scale, page, h, kc_ptr, kmin_ptr, ksc_ptr, ksum_ptr,
                 kc_ps, kmin_ps, ksc_ps, ksum_ps, P: tl.constexpr, D: tl.constexpr, GD: tl.constexpr,
                 NG: tl.constexpr, K_BITS: tl.constexpr, DOT_F16: tl.constexpr):
    """Scores [M, Π] of the rows' queries against a closed page's K (K_BITS-bit codes)."""
    PW: tl.constexpr = 32 // K_BITS
    s = tl.zeros((row_off.shape[0], P), tl.float32)
    code_base = kc_ptr + page * kc_ps + h * P * (D // PW)
    jt = tl.arange(0, P)
    for g in tl.static_range(NG):
        ch = h * D + g * GD + tl.arange(0, GD)
        k_scale = tl.load(ksc_ptr + page * ksc_ps + ch).to(tl.float32)
        k_min = tl.load(kmin_ptr + page * kmin_ps + ch).to(tl.float32)
        qs = load_q(q_base, row_off, row_ok, sm_scale, g, GD)
        q_code, q_mn, q_s = q8_along(qs * k_scale[None, :], 1)  # K's channel scale folded into Q
        k_codes = tl.trans(code_rows(code_base, D // PW, g, P, GD, P, K_BITS))
        k_sum = tl.load(ksum_ptr + page * ksum_ps + h * P * NG + jt * NG + g).to(tl.int32)[None, :]
        dot = int_dot(q_code.to(tl.int8), k_codes, DOT_F16) + 128 * k_sum  # exact Σ Qq·Kq
        s += q_s[:, None] * dot.to(tl.float32) + q_mn[:, None] * k_sum.to(tl.float32)
        s += tl.sum(qs * k_min[None, :], axis=1)[:, None]  # Q · m_K, exact in fp32
    return s


@triton.jit
def quant_pv(p, written, page, h, vc_ptr, vmin_ptr, vsc_ptr, vc_ps, vmin_ps, vsc_ps,
             P: tl.constexpr, D: tl.constexpr, GD: tl.constexpr, NG: tl.constexpr,
             V_BITS: tl.constexpr, DOT_F16: tl.constexpr):
    """P·V [M, NG, Gd] over one page's per-token V (V_BITS-bit codes); p [M, Π] is 0 off the
    visible keys, `written` = slots of the page holding quantized tokens."""
    PW: tl.constexpr = 32 // V_BITS
    jt = tl.arange(0, P)
    slot_ok = jt < written
    code_base = vc_ptr + page * vc_ps + h * P * (D // PW)
    out = tl.zeros((p.shape[0], NG, GD), tl.float32)
    for g in tl.static_range(NG):
        meta = h * P * NG + jt * NG + g
        v_scale = tl.load(vsc_ptr + page * vsc_ps + meta, mask=slot_ok, other=0.0).to(tl.float32)
        v_min = tl.load(vmin_ptr + page * vmin_ps + meta, mask=slot_ok, other=0.0).to(tl.float32)
        p_code, p_s = q8_zero_min_along(p * v_scale[None, :], 1)  # V's token scale folded into P
        v_codes, v_sum = v_codes_tile(code_base, D // PW, g, written, GD, P, V_BITS)
        dot = int_dot(p_code.to(tl.int8), v_codes, DOT_F16) + 128 * v_sum[None, :]  # undo the -128 shift
        o = p_s[:, None] * dot.to(tl.float32) + tl.sum(p * v_min[None, :], axis=1)[:, None]
        out += into_group(o, g, NG)
    return out


@triton.jit
def soft_cap(s, cap):
    """Logit soft-capping cap * tanh(s / cap) of finite scores (hack_ops.attention.soft_cap).
    tanh from one exp of -2|x| (no overflow; tl has no tanh that also runs in the interpreter);
    |error| <= ~1e-7 * cap, far below the kernels' tolerance."""
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0.0, -th, th)


@triton.jit
def masked_scores(s, valid, logit_cap, CAP: tl.constexpr):
    """Scores ready for the softmax: soft-capped when the layer has a cap (CAP), -inf off `valid`."""
    if CAP:
        s = soft_cap(s, logit_cap)
    return tl.where(valid, s, -float("inf"))


@triton.jit
def sink_block(q_base, row_off, row_ok, sm_scale, t, lo, sk_base, sv_base, s_sj, m_i, l_i, acc, logit_cap,
               GD: tl.constexpr, NG: tl.constexpr, S: tl.constexpr, BS: tl.constexpr, CAP: tl.constexpr):
    """Attend rows (queries at positions t [M], seeing keys from position lo [M] on: the sliding
    window, 0 without one) to their sequence's FP16 sinks (token j at sk_base / sv_base + j * s_sj)."""
    js = tl.arange(0, BS)
    ok = js < S
    off = js * s_sj
    s = fp16_scores(q_base, row_off, row_ok, sm_scale, sk_base, off, ok, sk_base, off, js < 0, GD, NG)
    s = masked_scores(s, ok[None, :] & (js[None, :] <= t[:, None]) & (js[None, :] >= lo[:, None]), logit_cap, CAP)
    p, m_i, l_i, acc = softmax_step(s, m_i, l_i, acc)
    acc += fp16_pv(p, sv_base, off, ok, sv_base, off, js < 0, GD, NG)
    return m_i, l_i, acc
