"""Triton prefill/extend attention over HACK pages (FlashAttention-2 style, causal, GQA).

Grid (query block, request, query head). The queries are a request's new tokens at positions
prefix_len.. of its sequence; they attend to the cached prefix pages and to themselves, with
decode-time visibility (each token sees what it would see if decoded one at a time):
  * FP16 sinks;
  * quantized pass, page by page: the rows that see the page closed (its last token is at or
    before them) attend to all of it with its K_BITS K and V_BITS V codes, homomorphically;
  * FP16 pass, over the block's own partitions: the rows inside a partition attend causally
    to its tokens with FP16 K (and V with a V tail; else the page's per-token quantized V). Old
    tokens come from the request's FP16 tails, new ones from the input k/v.
A (row, page) pair is in exactly one pass, so each pass masks the other's rows; the online
softmax is indifferent to the order. The store's pages phase must run before this kernel (new
V codes, newly closed K pages), its tail phase after (it overwrites the tails read here): see
HackPrefillAttention.run.
With a sliding window (WINDOW; row t sees keys t-window..t) the quantized pass starts at the
first page the block's first row can see, so pages wholly before every row's window are never
read, and each pass masks per token; CAP soft-caps the scaled scores. Both are constexpr
switches: without them the kernel is the same code as before they existed.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .jit_blocks import fp16_pv, fp16_scores, masked_scores, quant_pv, quant_scores, sink_block, softmax_step


@triton.jit
def hack_prefill_kernel(
    q_ptr, s_qt, s_qh, k_ptr, v_ptr, s_kt, s_kh, s_vt, s_vh,
    kc_ptr, kmin_ptr, ksc_ptr, ksum_ptr, vc_ptr, vmin_ptr, vsc_ptr,
    kc_ps, kmin_ps, ksc_ps, ksum_ps, vc_ps, vmin_ps, vsc_ps,
    tk_ptr, tv_ptr, s_tr, s_tj, s_th,
    sk_ptr, sv_ptr, s_ss, s_sj, s_sh,
    qo_indptr, prefix_lens, kv_indptr, kv_indices, tail_rows, sink_slots,
    o_ptr, s_ot, s_oh,
    sm_scale, window, logit_cap,
    REP: tl.constexpr, BM: tl.constexpr,
    P: tl.constexpr, D: tl.constexpr, GD: tl.constexpr, NG: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    S: tl.constexpr, BS: tl.constexpr, V_TAIL: tl.constexpr, DOT_F16: tl.constexpr,
    WINDOW: tl.constexpr = False, CAP: tl.constexpr = False,
):
    mb = tl.program_id(0)
    b = tl.program_id(1)
    hq = tl.program_id(2)
    h = hq // REP
    q0 = tl.load(qo_indptr + b)
    n = tl.load(qo_indptr + b + 1) - q0
    if mb * BM < n:
        L0 = tl.load(prefix_lens + b)
        L = L0 + n
        page0 = tl.load(kv_indptr + b)
        i = tl.arange(0, BM)
        row_ok = mb * BM + i < n
        t = L0 + mb * BM + i  # absolute position of each query row
        t_min = L0 + mb * BM
        t_max = tl.minimum(t_min + BM, L) - 1
        r3 = i[:, None, None]
        ok3 = (mb * BM + r3) < n
        ch = tl.arange(0, NG)[None, :, None] * GD + tl.arange(0, GD)[None, None, :]  # [1, NG, Gd]
        q_base = q_ptr + hq * s_qh
        q_off = (q0 + mb * BM + i).to(tl.int64) * s_qt

        m_i = tl.full((BM,), -float("inf"), tl.float32)
        l_i = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, NG, GD), tl.float32)
        jj = tl.arange(0, P)
        if WINDOW:
            lo = t - window  # each row's first visible key (<= 0: all)
            lo_min = tl.maximum(t_min - window, 0)  # the block's
        else:
            lo = t * 0
            lo_min = 0

        if S > 0:
            if lo_min < S:
                slot = tl.load(sink_slots + b).to(tl.int64)
                m_i, l_i, acc = sink_block(q_base, q_off, row_ok, sm_scale, t, lo, sk_ptr + slot * s_ss + h * s_sh,
                                           sv_ptr + slot * s_ss + h * s_sh, s_sj, m_i, l_i, acc, logit_cap,
                                           GD, NG, S, BS, CAP)
        # Quantized pass: pages closed for at least the block's last row (from the window's first).
        for pg in range(lo_min // P, (t_max + 1) // P):
            page = tl.load(kv_indices + page0 + pg).to(tl.int64)
            s = quant_scores(q_base, q_off, row_ok, sm_scale, page, h, kc_ptr, kmin_ptr, ksc_ptr, ksum_ptr,
                             kc_ps, kmin_ps, ksc_ps, ksum_ps, P, D, GD, NG, K_BITS, DOT_F16)
            sees_closed = row_ok & (t >= (pg + 1) * P - 1)
            valid = sees_closed[:, None] & (pg * P + jj >= S)[None, :]
            if WINDOW:
                valid = valid & ((pg * P + jj)[None, :] >= lo[:, None])
            s = masked_scores(s, valid, logit_cap, CAP)
            p, m_i, l_i, acc = softmax_step(s, m_i, l_i, acc)
            acc += quant_pv(p, P, page, h, vc_ptr, vmin_ptr, vsc_ptr, vc_ps, vmin_ps, vsc_ps,
                            P, D, GD, NG, V_BITS, DOT_F16)
        # FP16 pass: each row's own, still open partition (old tokens from the tails, new ones
        # from the input).
        trow = tl.load(tail_rows + b).to(tl.int64)
        t_base = trow * s_tr + h * s_th
        for pg in range(t_min // P, t_max // P + 1):
            pos = pg * P + jj
            old = pos < L0
            new = (pos >= L0) & (pos <= t_max)
            src = (q0 + pos - L0).to(tl.int64)
            s = fp16_scores(q_base, q_off, row_ok, sm_scale, tk_ptr + t_base, jj * s_tj, old,
                            k_ptr + h * s_kh, src * s_kt, new, GD, NG)
            inside = row_ok & (t >= pg * P) & (t < (pg + 1) * P - 1)
            valid = inside[:, None] & (pos[None, :] <= t[:, None]) & (pos >= S)[None, :]
            if WINDOW:
                valid = valid & (pos[None, :] >= lo[:, None])
            s = masked_scores(s, valid, logit_cap, CAP)
            p, m_i, l_i, acc = softmax_step(s, m_i, l_i, acc)
            if V_TAIL:
                acc += fp16_pv(p, tv_ptr + t_base, jj * s_tj, old, v_ptr + h * s_vh, src * s_vt, new, GD, NG)
            else:
                page = tl.load(kv_indices + page0 + pg).to(tl.int64)
                acc += quant_pv(p, tl.minimum(P, L - pg * P), page, h, vc_ptr, vmin_ptr, vsc_ptr,
                                vc_ps, vmin_ps, vsc_ps, P, D, GD, NG, V_BITS, DOT_F16)

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None, None]  # padding rows have l = 0
        tl.store(o_ptr + (q0 + mb * BM + r3).to(tl.int64) * s_ot + hq * s_oh + ch,
                 out.to(o_ptr.dtype.element_ty), mask=ok3)
