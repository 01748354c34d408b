"""Sparse decode's selection on the pages' own device, for the GPU decode kernels' per-head tables.

hack_ops.sparse is the reference (its selection ends on the CPU); the CPU serving path has its
compiled twin (hack_ops.paged.sparse). This is the same one-level selection on the device of the
pages: the bound of every closed page scored for every query head of a group by one Triton
kernel reading K's minimum and scale inside the pages (hack_ops.triton.page_bound), the first
and the recent pages kept, the best of the rest by top-k, then the chosen pages in position
order and the open page as the CSR page table both decode kernels take with head_tables
(hack_ops.cuda.CudaDecodeAttention / hack_ops.triton.HackDecodeAttention .plan). The request
lengths are host integers (a plan has them), so every count and width is known before the
launches: the host's vectors go over in one copy, the CSR's offsets and index in another
(DeviceSelection.head_csr), and nothing is read back from the device. Refinement and two levels are not here:
the bound alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..layout import PageLayout
from ..paged.plan import ForwardPlan
from ..paged.sparse import PageSelection, to_device
from ..sparse import SparseConfig, select_pages
from .page_bound import page_bound_scores


@dataclass
class DeviceSelection(PageSelection):
    """A PageSelection whose per-head page counts are also known on the host, so that its CSR
    tables (what engine.gpu_attention plans a kernel on) need no read-back from the device."""

    pages_per_head: tuple[int, ...] = ()  # request b's pages per KV head: closed read, + 1 with an open page
    closed_per_head: tuple[int, ...] = ()  # ... its closed pages alone

    def head_csr(self) -> tuple[Tensor, Tensor]:
        return self.head_csr_from_host(list(self.pages_per_head))

    def closed_read(self) -> int:
        return sum(self.closed_per_head)  # from the host: no read-back per layer


def _host_rows(rows: list[list[int]], device: torch.device) -> Tensor:
    """Host integer vectors of one length as a long [len(rows), B] tensor on `device`, in one copy."""
    return to_device(torch.tensor(rows, dtype=torch.long).reshape(len(rows), len(rows[0])), device)


def device_selection(layout: PageLayout, k_buf: Tensor, pages: Tensor, seq_lens: list[int], q: Tensor,
                     cfg: SparseConfig) -> DeviceSelection:
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
    closed = [s // p for s in seq_lens]
    budget = cfg.budget_pages(p)
    n = max(1, max(closed, default=0))
    count = [min(c, budget) for c in closed]
    recent = min(cfg.recent_pages(p), budget - 1)  # the first page stays in the budget
    last = [max(0, -(-s // p) - 1) for s in seq_lens]
    lens = [c * p + s % p for c, s in zip(count, seq_lens)]
    nc, cnt, recent_from, last_t, lens_t = _host_rows([closed, count, [c - recent for c in closed], last, lens], dev)
    ids = to_device(pages, dev)
    if ids.shape[1] < n:  # no request has a closed page: the kernel reads no id, the output needs one column
        ids = torch.nn.functional.pad(ids, (0, n - ids.shape[1]))
    scores = page_bound_scores(layout, k_buf, ids, nc, n, to_device(q, dev), cfg.score)
    idx, _ = select_pages(scores, nc, budget, recent_from, width=max(count, default=0))  # no read-back
    w = idx.shape[-1]
    # a request with fewer than w pages took padding positions (past its own, sorted after them):
    # column count[b] becomes its open page, the rest is never read
    positions = torch.cat([idx, torch.zeros(b, h, 1, dtype=torch.long, device=dev)], -1)
    cols = torch.arange(w + 1, device=dev)[None, None, :]
    positions = torch.where(cols == cnt[:, None, None], nc[:, None, None], positions)
    positions = positions.masked_fill(cols > cnt[:, None, None], 0)
    table = torch.gather(ids.to(torch.long)[:, None, :].expand(b, h, -1), 2,
                         torch.minimum(positions, last_t[:, None, None]))
    per_head = tuple(c + int(s % p > 0) for c, s in zip(count, seq_lens))
    return DeviceSelection(page_size=p, positions=positions, table=table, n_closed=cnt, seq_lens=lens_t,
                           resident=nc, pages_per_head=per_head, closed_per_head=tuple(count))


def select_head_tables(layout: PageLayout, k_buf: Tensor, pages: Tensor, seq_lens: list[int], q: Tensor,
                       cfg: SparseConfig) -> tuple[Tensor, Tensor, Tensor]:
    """device_selection as what plan(..., head_tables=True) takes: (kv_indptr int32 [B+1],
    kv_indices int32, seq_lens int32 [B]), with no read-back from the device."""
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
    buf = store.k_pages[layer]
    key = ("sparse_device_pages", str(buf.device))  # the plan's (host) page table, copied once per forward
    pages = plan.memo.get(key)
    if pages is None:
        pages = plan.memo[key] = to_device(plan.page_table, buf.device)
    return device_selection(store.layout_for(layer), buf, pages, plan.seq_list, q, cfg)
