"""Triton store kernel: quantize new tokens into HACK pages (orientation 'channel_k', layout v2).

One program per (touched page, request, KV head x head_dim group of Gd channels).
K codes have K_BITS bits, V codes V_BITS (HackConfig.bits: they may differ).
Pages phase, for its page:
  * if the page is now complete, quantize it once: K per channel over the page's non-sink
    tokens (codes, min/scale, per-token K code sums) and, when V has an FP16 tail
    (tail_tensors='kv', the default), V per token (codes, min/scale). Old tokens come from the
    request's FP16 tails, new ones from the input rounded to FP16 (so the result does not
    depend on how the tokens were batched);
  * without a V tail (tail_tensors='per_channel'), V of the new tokens is quantized at once,
    from the input precision;
  * sink tokens (positions < sink_tokens) go to the FP16 sink buffers; in the page they keep
    code 0 and (V) min 0, scale 0 (hack_ops.layout);
  * with range_search, each group's range is the least-squared-error clipped candidate, as in
    hack_ops.quant (the launch disables FMA contraction so the arithmetic matches bit for bit).
Tail phase: the new tokens of the page that stays open are appended to the FP16 tail(s). The
tail is cleared logically when its page closes (the next token overwrites offset 0).
The pages phase reads the old tail and the tail phase overwrites it, so a request with new
tokens in several pages needs two launches (the prefill runs its attention in between).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .jit_math import code_of, kv_meta, search_range


@triton.jit
def _pack(codes, ROWS: tl.constexpr, COLS: tl.constexpr, BITS: tl.constexpr):
    """[ROWS, COLS] int32 codes -> [ROWS, COLS // (32 // BITS)] little-endian int32 words, the
    bytes of hack_ops.packing (the fields are disjoint, so the wrapping sum is a bitwise or)."""
    PW: tl.constexpr = 32 // BITS
    c3 = tl.reshape(codes, (ROWS, COLS // PW, PW))
    shift = (tl.arange(0, PW) * BITS)[None, None, :]
    return tl.sum(c3 << shift, axis=2)


@triton.jit
def _store_v_tokens(x, rows, is_sink, page, h, g, j, vc_ptr, vmin_ptr, vsc_ptr, vc_ps, vmin_ps, vsc_ps,
                    P: tl.constexpr, D: tl.constexpr, GD: tl.constexpr, NG: tl.constexpr,
                    V_BITS: tl.constexpr, META_F16: tl.constexpr, RANGE_SEARCH: tl.constexpr):
    """Quantize V per token (x [Π, Gd], head_dim group g) to V_BITS codes and write the `rows` slots."""
    LEVELS: tl.constexpr = (1 << V_BITS) - 1
    PW: tl.constexpr = 32 // V_BITS
    ROWW: tl.constexpr = D // PW
    lo = tl.min(x, axis=1)
    hi = tl.max(x, axis=1)
    if RANGE_SEARCH:
        lo, hi = search_range(x, (j >= 0)[:, None], lo, hi, 1, LEVELS, META_F16)
    mn, sc = kv_meta(lo, hi, LEVELS, META_F16)
    q = tl.where(is_sink[:, None], 0.0, code_of(x, mn[:, None], sc[:, None], LEVELS))
    meta = h * P * NG + j * NG + g
    tl.store(vmin_ptr + page * vmin_ps + meta, tl.where(is_sink, 0.0, mn).to(vmin_ptr.dtype.element_ty), mask=rows)
    tl.store(vsc_ptr + page * vsc_ps + meta, tl.where(is_sink, 0.0, sc).to(vsc_ptr.dtype.element_ty), mask=rows)
    word = g * (GD // PW) + tl.arange(0, GD // PW)
    tl.store(vc_ptr + page * vc_ps + h * P * ROWW + j[:, None] * ROWW + word[None, :],
             _pack(q.to(tl.int32), P, GD, V_BITS), mask=rows[:, None])


@triton.jit
def hack_store_kernel(
    k_ptr, v_ptr, s_kt, s_kh, s_vt, s_vh,
    qo_indptr, prefix_lens, kv_indptr, kv_indices, tail_rows, sink_slots,
    kc_ptr, kmin_ptr, ksc_ptr, ksum_ptr, vc_ptr, vmin_ptr, vsc_ptr,
    kc_ps, kmin_ps, ksc_ps, ksum_ps, vc_ps, vmin_ps, vsc_ps,
    tk_ptr, tv_ptr, s_tr, s_tj, s_th,
    sk_ptr, sv_ptr, s_ss, s_sj, s_sh,
    P: tl.constexpr, D: tl.constexpr, GD: tl.constexpr, NG: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, S: tl.constexpr, META_F16: tl.constexpr, V_TAIL: tl.constexpr,
    RANGE_SEARCH: tl.constexpr, WRITE_PAGES: tl.constexpr, WRITE_TAIL: tl.constexpr,
):
    pid_p = tl.program_id(0)
    b = tl.program_id(1)
    hg = tl.program_id(2)
    h = hg // NG
    g = hg % NG
    # K's code geometry (V's is in _store_v_tokens)
    LEVELS: tl.constexpr = (1 << K_BITS) - 1
    PW: tl.constexpr = 32 // K_BITS
    ROWW: tl.constexpr = D // PW

    q0 = tl.load(qo_indptr + b)
    n = tl.load(qo_indptr + b + 1) - q0
    L0 = tl.load(prefix_lens + b)
    L = L0 + n
    pg = L0 // P + pid_p
    if (n > 0) & (pg * P < L):
        page = tl.load(kv_indices + tl.load(kv_indptr + b) + pg).to(tl.int64)
        trow = tl.load(tail_rows + b).to(tl.int64)
        j = tl.arange(0, P)
        d = g * GD + tl.arange(0, GD)
        pos = pg * P + j
        new = (pos >= L0) & (pos < L)
        old = (pos < L0)[:, None]
        is_sink = pos < S
        src = (q0 + pos - L0).to(tl.int64)
        k_off = src[:, None] * s_kt + h * s_kh + d[None, :]
        v_off = src[:, None] * s_vt + h * s_vh + d[None, :]
        t_off = trow * s_tr + j[:, None] * s_tj + h * s_th + d[None, :]
        if WRITE_PAGES:
            closes = (pg + 1) * P <= L
            if closes:
                # K per channel over the page's non-sink tokens.
                kt = tl.load(tk_ptr + t_off, mask=old, other=0.0).to(tl.float32)
                kn = tl.load(k_ptr + k_off, mask=new[:, None], other=0.0).to(tl.float16).to(tl.float32)
                k = tl.where(old, kt, kn)
                keep = (pos >= S)[:, None]
                kmn = tl.min(tl.where(keep, k, float("inf")), axis=0)
                kmx = tl.max(tl.where(keep, k, -float("inf")), axis=0)
                empty = kmn > kmx
                kmn = tl.where(empty, 0.0, kmn)
                kmx = tl.where(empty, 0.0, kmx)
                if RANGE_SEARCH:
                    kmn, kmx = search_range(k, keep, kmn, kmx, 0, LEVELS, META_F16)
                kmn, ks = kv_meta(kmn, kmx, LEVELS, META_F16)
                kq = tl.where(keep, code_of(k, kmn[None, :], ks[None, :], LEVELS), 0.0)
                word = g * (GD // PW) + tl.arange(0, GD // PW)
                tl.store(kc_ptr + page * kc_ps + h * P * ROWW + j[:, None] * ROWW + word[None, :],
                         _pack(kq.to(tl.int32), P, GD, K_BITS))
                tl.store(kmin_ptr + page * kmin_ps + h * D + d, kmn.to(kmin_ptr.dtype.element_ty))
                tl.store(ksc_ptr + page * ksc_ps + h * D + d, ks.to(ksc_ptr.dtype.element_ty))
                ksum = tl.sum(kq, axis=1).to(tl.int32)
                tl.store(ksum_ptr + page * ksum_ps + h * P * NG + j * NG + g, ksum.to(ksum_ptr.dtype.element_ty))
                if V_TAIL:
                    vt = tl.load(tv_ptr + t_off, mask=old, other=0.0).to(tl.float32)
                    vn = tl.load(v_ptr + v_off, mask=new[:, None], other=0.0).to(tl.float16).to(tl.float32)
                    _store_v_tokens(tl.where(old, vt, vn), j < P, is_sink, page, h, g, j, vc_ptr, vmin_ptr, vsc_ptr,
                                    vc_ps, vmin_ps, vsc_ps, P, D, GD, NG, V_BITS, META_F16, RANGE_SEARCH)
            if not V_TAIL:
                vn = tl.load(v_ptr + v_off, mask=new[:, None], other=0.0).to(tl.float32)
                _store_v_tokens(vn, new, is_sink, page, h, g, j, vc_ptr, vmin_ptr, vsc_ptr,
                                vc_ps, vmin_ps, vsc_ps, P, D, GD, NG, V_BITS, META_F16, RANGE_SEARCH)
            if S > 0:
                sm = (new & is_sink)[:, None]
                slot = tl.load(sink_slots + b).to(tl.int64)
                s_off = slot * s_ss + j[:, None] * s_sj + h * s_sh + d[None, :]
                tl.store(sk_ptr + s_off, tl.load(k_ptr + k_off, mask=sm, other=0.0).to(tl.float16), mask=sm)
                tl.store(sv_ptr + s_off, tl.load(v_ptr + v_off, mask=sm, other=0.0).to(tl.float16), mask=sm)
        if WRITE_TAIL:
            if pg == L // P:  # the page stays open: append its new tokens
                tl.store(tk_ptr + t_off, tl.load(k_ptr + k_off, mask=new[:, None], other=0.0).to(tl.float16),
                         mask=new[:, None])
                if V_TAIL:
                    tl.store(tv_ptr + t_off, tl.load(v_ptr + v_off, mask=new[:, None], other=0.0).to(tl.float16),
                             mask=new[:, None])
