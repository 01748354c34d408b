"""Sparse decode's selection on the pages' own device, for the GPU decode kernels' per-head tables.

hack_ops.sparse is the reference (its selection ends on the CPU); the CPU serving path has its
compiled twin (hack_ops.paged.sparse). This is the same one-level selection in torch ops that
stay on the device of the pages: each closed page's K minimum and scale gathered from inside the
pages, the bound scored for every query head of a group (hack_ops.sparse.page_scores), the first
and the recent pages kept, the best of the rest by top-k, then the chosen pages in position
order and the open page as the CSR page table both decode kernels take with head_tables
(hack_ops.cuda.CudaDecodeAttention / hack_ops.triton.HackDecodeAttention .plan). The request
lengths are host integers (a plan has them), so nothing waits on the device but the final
CSR's boolean gather. Refinement and two levels are not here: the bound alone.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..layout import PageLayout
from ..paged.plan import ForwardPlan
from ..paged.sparse import PageSelection
from ..sparse import PageScore, SparseConfig, page_scores, select_pages


def device_selection(layout: PageLayout, k_buf: Tensor, pages: Tensor, seq_lens: list[int], q: Tensor,
                     cfg: SparseConfig) -> PageSelection:
    """The pages each (request, KV head) reads in one decode step under `cfg`, on k_buf's device:
    pages [B, >= max pages] (request b's page ids in position order, padded with any valid id),
    seq_lens its B lengths (the new token counted), q [B, Hq, D]. Request b's heads each read
    min(closed pages, budget) pages, then its open page, its length shortened to match."""
    if cfg.refine > 1 or cfg.group_pages:
        raise NotImplementedError("the device selection is the bound alone: no refinement, no two levels")
    if not layout.k.per_channel:
        raise ValueError("sparse decode scores pages from K's per-channel side tables: orientation 'channel_k' only")
    p, h, d = layout.page_size, layout.num_heads, layout.head_dim
    dev, b = k_buf.device, len(seq_lens)
    if q.shape[0] != b or q.shape[1] % h or q.shape[2] != d:
        raise ValueError(f"q must be [{b}, a multiple of {h}, {d}], got {tuple(q.shape)}")
    if pages.shape[0] != b or pages.shape[1] < max((-(-s // p) for s in seq_lens), default=0):
        raise ValueError(f"pages must be [{b}, >= the longest request's pages], got {tuple(pages.shape)}")
    closed = [n // p for n in seq_lens]
    budget = cfg.budget_pages(p)
    n = max(1, max(closed, default=0))
    ids = pages.to(device=dev, dtype=torch.long)
    ids = ids[:, :n] if ids.shape[1] >= n else torch.nn.functional.pad(ids, (0, n - ids.shape[1]))
    mn = layout.k.view(k_buf, "minimum")[ids].transpose(1, 2)  # [B, H, N, D]
    sc = layout.k.view(k_buf, "scale")[ids].transpose(1, 2)
    scores = page_scores(q.reshape(b, h, q.shape[1] // h, d), mn, sc, layout.k.bits, PageScore(cfg.score))
    nc = torch.tensor(closed, device=dev)
    recent_from = nc - min(cfg.recent_pages(p), budget - 1)  # the first page stays in the budget
    idx, cnt = select_pages(scores, nc, budget, recent_from)  # on the pages' device
    count = [min(c, budget) for c in closed]
    w = max(count, default=0)
    # a request with fewer than w pages took padding positions (past its own, sorted after them):
    # column count[b] becomes its open page, the rest is never read
    positions = torch.cat([idx, torch.zeros(b, h, 1, dtype=torch.long, device=dev)], -1)
    cols = torch.arange(w + 1, device=dev)[None, None, :]
    positions = torch.where(cols == cnt[:, None, None], nc[:, None, None], positions)
    positions = positions.masked_fill(cols > cnt[:, None, None], 0)
    last = torch.tensor([max(0, -(-s_ // p) - 1) for s_ in seq_lens], device=dev)
    table = torch.gather(pages.to(device=dev, dtype=torch.long)[:, None, :].expand(b, h, -1), 2,
                         torch.minimum(positions, last[:, None, None]))
    lens = torch.tensor([c * p + s_ % p for c, s_ in zip(count, seq_lens)], device=dev)
    return PageSelection(page_size=p, positions=positions, table=table, n_closed=cnt, seq_lens=lens, resident=nc)


def select_head_tables(layout: PageLayout, k_buf: Tensor, pages: Tensor, seq_lens: list[int], q: Tensor,
                       cfg: SparseConfig) -> tuple[Tensor, Tensor, Tensor]:
    """device_selection as what plan(..., head_tables=True) takes: (kv_indptr int32 [B+1],
    kv_indices int32, seq_lens int32 [B])."""
    sel = device_selection(layout, k_buf, pages, seq_lens, q, cfg)
    indptr, indices = sel.head_csr()
    return indptr, indices, sel.seq_lens.to(torch.int32)


def select_on_device(store, layer: int, plan: ForwardPlan, q: Tensor, cfg: SparseConfig) -> PageSelection | None:
    """hack_ops.paged.sparse.select_for_decode for the GPU path (engine.gpu_attention): the same
    selection (the bound alone) on the store's device; None when no request has more closed
    pages than the budget (every page is read: dense decode)."""
    if not plan.is_decode:
        raise ValueError("sparse selection is for decode steps (one new token per request)")
    p = store.page_size
    if max((s // p for s in plan.seq_list), default=0) <= cfg.budget_pages(p):
        return None
    return device_selection(store.layout_for(layer), store.k_pages[layer], plan.page_table, plan.seq_list, q, cfg)
