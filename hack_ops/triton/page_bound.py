"""Sparse decode's page scores as one Triton kernel, read in place from the K pages.

hack_ops.sparse.page_scores is the reference: for request b, KV head h and closed page n, the
max over the GQA group's R query heads of q.min + L * relu(q).scale (PageScore.BOUND) or
q.min + alpha * L * q.scale (PageScore.LINEAR), from the page's per-channel K minimum and scale.
Here each program takes BLOCK_N page positions of one (request, KV head): it looks their page ids
up in the request's page table, loads the side tables straight from the page buffer (typed
views of k_buf's minimum and scale sections: the same bytes, no gathered copy), and scores
them for the R query heads in fp32. Positions at or past the request's closed pages hold -inf
(what select_pages ignores), so one launch covers a batch of unequal lengths.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..layout import PageLayout
from ..sparse import LINEAR_ALPHA, PageScore

_META = (torch.float16, torch.float32)


@triton.jit
def page_bound_kernel(
    q_ptr, s_qb, s_qh,
    mn_ptr, sc_ptr, meta_ps,
    pages_ptr, s_pb, s_pn, n_closed_ptr,
    out_ptr, s_ob, s_oh, width, coef,
    R: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    closed = n < tl.load(n_closed_ptr + b)
    # padding entries of the page table are never read: they need not name a valid page
    page = tl.load(pages_ptr + b * s_pb + n * s_pn, mask=closed, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    off = page[:, None] * meta_ps + h * D + d[None, :]  # int64: a large pool's byte offsets pass 2^31
    ok = closed[:, None] & d_ok[None, :]
    mn = tl.load(mn_ptr + off, mask=ok, other=0.0).to(tl.float32)
    sc = tl.load(sc_ptr + off, mask=ok, other=0.0).to(tl.float32)
    best = tl.full((BLOCK_N,), -float("inf"), tl.float32)
    q_row = q_ptr + b.to(tl.int64) * s_qb + h * R * s_qh
    for r in range(R):
        qr = tl.load(q_row + r * s_qh + d, mask=d_ok, other=0.0).to(tl.float32)
        qs = qr
        if RELU:  # the bound: a channel's top (min + L scale) counts where q > 0, its min elsewhere
            qs = tl.maximum(qr, 0.0)
        best = tl.maximum(best, tl.sum(mn * qr[None, :], 1) + coef * tl.sum(sc * qs[None, :], 1))
    best = tl.where(closed, best, -float("inf"))
    tl.store(out_ptr + b * s_ob + h * s_oh + n, best, mask=n < width)


def page_bound_scores(layout: PageLayout, k_buf: Tensor, pages: Tensor, n_closed: Tensor, width: int, q: Tensor,
                      score: PageScore | str = PageScore.BOUND) -> Tensor:
    """hack_ops.sparse.page_scores of every request's closed pages, in one launch on k_buf's
    device: pages [B, >= width] (request b's page ids in position order; entries at or past
    n_closed[b] are not read), n_closed [B] on k_buf's device, width (a host int >= every
    n_closed) the output's last dimension, q [B, Hq, D] (Hq a multiple of the layout's heads).
    Returns float32 [B, H, width], -inf at positions >= n_closed[b]."""
    score = PageScore(score)
    if not layout.k.per_channel:
        raise ValueError("sparse decode scores pages from K's per-channel side tables: orientation 'channel_k' only")
    h, d = layout.num_heads, layout.head_dim
    if k_buf.dtype != torch.uint8 or k_buf.dim() != 2 or k_buf.shape[1] != layout.k.page_bytes or k_buf.stride(1) != 1:
        raise ValueError(f"k_buf must be uint8 [num_pages, {layout.k.page_bytes}] with contiguous rows, got "
                         f"{k_buf.dtype} {tuple(k_buf.shape)}")
    b = q.shape[0]
    if q.dim() != 3 or q.shape[1] % h or q.shape[2] != d:
        raise ValueError(f"q must be [B, a multiple of {h}, {d}], got {tuple(q.shape)}")
    if pages.dim() != 2 or pages.shape[0] != b or pages.shape[1] < width or n_closed.shape != (b,):
        raise ValueError(f"pages must be [{b}, >= {width}] and n_closed [{b}], got {tuple(pages.shape)}, "
                         f"{tuple(n_closed.shape)}")
    if width < 1:
        raise ValueError(f"width must be positive, got {width}")
    mn = layout.k.view(k_buf, "minimum")  # [num_pages, H, D], the meta dtype: views of k_buf, not copies
    sc = layout.k.view(k_buf, "scale")
    if mn.dtype not in _META or mn.stride()[1:] != (d, 1):
        raise ValueError(f"K's side tables must be fp16 or fp32 [H, D] per page, got {mn.dtype} {tuple(mn.stride())}")
    dev = k_buf.device
    if not (q.device == pages.device == n_closed.device == dev):
        raise ValueError(f"q, pages and n_closed must be on k_buf's device {dev}")
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty(b, h, width, dtype=torch.float32, device=dev)
    if b == 0:
        return out
    levels = float((1 << layout.k.bits) - 1)
    coef = levels if score == PageScore.BOUND else LINEAR_ALPHA * levels
    block_n = min(32, max(16, triton.next_power_of_2(width)))
    grid = (b, h, triton.cdiv(width, block_n))
    page_bound_kernel[grid](q, q.stride(0), q.stride(1), mn, sc, mn.stride(0), pages, pages.stride(0),
                            pages.stride(1), n_closed, out, out.stride(0), out.stride(1), width, coef,
                            R=q.shape[1] // h, D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_N=block_n,
                            RELU=score == PageScore.BOUND, num_warps=4)
    return out
