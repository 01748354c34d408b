"""Triton decode attention over HACK pages (flash-decoding: split along the sequence + combine).

Grid (request, KV head, split). The rows of a program are the REP query heads that share the
KV head (padded to 16 for the MMA), so each K/V page is loaded and unpacked once per group.
A split owns a contiguous range of pages: split 0 also attends to the FP16 sinks; the split
holding the open page reads its K from the request's FP16 tail, and its V from the V tail
(tail_tensors='kv', the default) or from the page's per-token codes ('per_channel').
A sliding window (WINDOW; the query at t = L-1 sees keys t-window..t) moves the splits' start
to the window's first page, so pages wholly before it are never read; the boundary page, the
open partition and the sinks are masked per token. CAP soft-caps the scaled scores. HEAD_TABLES
reads one page list per KV head (sparse decode's selection: every head of a request reads as many
pages, its own). All three are constexpr switches: the kernel without them is the same code as
before they existed.
With one split the kernel normalizes and writes the output itself; otherwise it writes
(acc, max, sum) per split and hack_decode_combine merges them.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .jit_blocks import fp16_pv, fp16_scores, masked_scores, quant_pv, quant_scores, sink_block, softmax_step


@triton.jit
def hack_decode_kernel(
    q_ptr, s_qb, s_qh,
    kc_ptr, kmin_ptr, ksc_ptr, ksum_ptr, vc_ptr, vmin_ptr, vsc_ptr,
    kc_ps, kmin_ps, ksc_ps, ksum_ps, vc_ps, vmin_ps, vsc_ps,
    tk_ptr, tv_ptr, s_tr, s_tj, s_th,
    sk_ptr, sv_ptr, s_ss, s_sj, s_sh,
    kv_indptr, kv_indices, seq_lens, tail_rows, sink_slots,
    o_ptr, s_ob, s_oh, m_ptr, l_ptr,
    sm_scale, pages_per_split, window, logit_cap,
    REP: tl.constexpr, BLOCK_H: tl.constexpr,
    P: tl.constexpr, D: tl.constexpr, GD: tl.constexpr, NG: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    S: tl.constexpr, BS: tl.constexpr, V_TAIL: tl.constexpr, NSPLIT: tl.constexpr, DOT_F16: tl.constexpr,
    WINDOW: tl.constexpr = False, CAP: tl.constexpr = False, HEAD_TABLES: tl.constexpr = False,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    L = tl.load(seq_lens + b)
    n_closed = L // P
    r = L % P
    n_pages = (L + P - 1) // P
    if WINDOW:
        lo = tl.maximum(L - 1 - window, 0)  # the first visible key
        pg_from = tl.maximum(lo, S)  # the first key the page passes attend to (sinks have their own)
    else:
        lo = 0
        pg_from = S
    first = lo // P + split * pages_per_split  # the splits cover the window's pages only
    last = tl.minimum(first + pages_per_split, n_pages)
    page0 = tl.load(kv_indptr + b)
    if HEAD_TABLES:  # sparse decode: each KV head its own list of the request's n_b pages, heads in turn
        page0 = page0 * tl.num_programs(1) + h * (tl.load(kv_indptr + b + 1) - page0)

    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < REP
    qh = h * REP + rows
    r3 = rows[:, None, None]
    ch = tl.arange(0, NG)[None, :, None] * GD + tl.arange(0, GD)[None, None, :]  # [1, NG, Gd]
    q_base = q_ptr + b * s_qb
    q_off = (qh * s_qh).to(tl.int64)

    m_i = tl.full((BLOCK_H,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, NG, GD), tl.float32)
    t = tl.zeros((BLOCK_H,), tl.int32) + (L - 1)
    jj = tl.arange(0, P)

    if S > 0:
        if split == 0:
            if lo < S:  # static without a window; with one, the sinks may all be out of it
                slot = tl.load(sink_slots + b).to(tl.int64)
                m_i, l_i, acc = sink_block(q_base, q_off, row_ok, sm_scale, t, t * 0 + lo,
                                           sk_ptr + slot * s_ss + h * s_sh, sv_ptr + slot * s_ss + h * s_sh, s_sj,
                                           m_i, l_i, acc, logit_cap, GD, NG, S, BS, CAP)
    for pg in range(first, tl.minimum(last, n_closed)):
        page = tl.load(kv_indices + page0 + pg).to(tl.int64)
        s = quant_scores(q_base, q_off, row_ok, sm_scale, page, h, kc_ptr, kmin_ptr, ksc_ptr, ksum_ptr,
                         kc_ps, kmin_ps, ksc_ps, ksum_ps, P, D, GD, NG, K_BITS, DOT_F16)
        s = masked_scores(s, (pg * P + jj >= pg_from)[None, :], logit_cap, CAP)
        p, m_i, l_i, acc = softmax_step(s, m_i, l_i, acc)
        acc += quant_pv(p, P, page, h, vc_ptr, vmin_ptr, vsc_ptr, vc_ps, vmin_ps, vsc_ps,
                        P, D, GD, NG, V_BITS, DOT_F16)
    if (r > 0) & (n_closed >= first) & (n_closed < last):
        # The open partition: K (and V with a V tail) from the request's FP16 tails.
        trow = tl.load(tail_rows + b).to(tl.int64)
        tok = jj < r
        off = jj * s_tj
        t_base = trow * s_tr + h * s_th
        s = fp16_scores(q_base, q_off, row_ok, sm_scale, tk_ptr + t_base, off, tok, tk_ptr + t_base, off, jj < 0,
                        GD, NG)
        s = masked_scores(s, (tok & (n_closed * P + jj >= pg_from))[None, :], logit_cap, CAP)
        p, m_i, l_i, acc = softmax_step(s, m_i, l_i, acc)
        if V_TAIL:
            acc += fp16_pv(p, tv_ptr + t_base, off, tok, tv_ptr + t_base, off, jj < 0, GD, NG)
        else:
            page = tl.load(kv_indices + page0 + n_closed).to(tl.int64)
            acc += quant_pv(p, r, page, h, vc_ptr, vmin_ptr, vsc_ptr, vc_ps, vmin_ps, vsc_ps,
                            P, D, GD, NG, V_BITS, DOT_F16)

    if NSPLIT == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None, None]  # padding rows have l = 0
        tl.store(o_ptr + b * s_ob + (h * REP + r3) * s_oh + ch, out.to(o_ptr.dtype.element_ty), mask=r3 < REP)
    else:
        # Partials: acc [B, HQ, NSPLIT, D], max and sum [B, HQ, NSPLIT] (o_ptr is the acc buffer).
        hq_total = tl.num_programs(1) * REP
        part = (b * hq_total + h * REP + r3) * NSPLIT + split
        tl.store(o_ptr + part * D + ch, acc, mask=r3 < REP)
        ml = (b * hq_total + qh) * NSPLIT + split
        tl.store(m_ptr + ml, m_i, mask=row_ok)
        tl.store(l_ptr + ml, l_i, mask=row_ok)


@triton.jit
def hack_decode_combine(
    o_part, m_part, l_part, o_ptr, s_ob, s_oh, D: tl.constexpr, NSPLIT: tl.constexpr, BLOCK_SPLIT: tl.constexpr,
):
    """Merge the splits of one (request, query head): rescale each to the global max."""
    b = tl.program_id(0)
    qh = tl.program_id(1)
    sp = tl.arange(0, BLOCK_SPLIT)
    ok = sp < NSPLIT
    base = (b * tl.num_programs(1) + qh) * NSPLIT
    m = tl.load(m_part + base + sp, mask=ok, other=-float("inf"))
    l = tl.load(l_part + base + sp, mask=ok, other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(m == -float("inf"), 0.0, tl.exp(m - m_all))
    dd = tl.arange(0, D)
    acc = tl.load(o_part + (base + sp[:, None]) * D + dd[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(o_ptr + b * s_ob + qh * s_oh + dd, out.to(o_ptr.dtype.element_ty))
