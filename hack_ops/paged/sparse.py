"""Sparse decode on the paged store: the pages each (request, KV head) reads in one decode step.

The selection (hack_ops.sparse) scores each request's closed pages from their K minimum and
scale, read where the pages keep them (no other metadata), and turns the choice into what the
decode kernels already take: a page table, per (request, KV head) here, the selected closed
pages in position order then the open page, with the request's length shortened to match
(hack_ops.sparse: a sparse step is the ordinary decode of that shorter sequence). The compiled
kernel reads the per-head table in place (cpu_kernel.decode); the PyTorch path gathers each
head's own pages (pages.request_pages).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..sparse import SparseConfig, select
from .plan import ForwardPlan


@dataclass
class PageSelection:
    """What one decode step reads. W = the widest request's selected closed pages + 1."""

    page_size: int
    positions: Tensor  # [B, H, W] long: page positions read, ascending, then the open page; padding after
    table: Tensor  # [B, H, W] long: the page ids at those positions (padding: a page the kernel never reads)
    n_closed: Tensor  # [B] long: closed pages each head of the request reads
    seq_lens: Tensor  # [B] long: the shortened length: n_closed * Π + the open partition's tokens
    resident: Tensor  # [B] long: the request's closed pages (what a dense step reads)

    @property
    def batch_size(self) -> int:
        return int(self.n_closed.shape[0])

    def heads_pages(self, b: int) -> Tensor:
        """Request b's page ids per KV head [H, n]: the n pages its heads read (closed, then
        the open page when it holds tokens)."""
        has_open = int(self.seq_lens[b]) > int(self.n_closed[b]) * self.page_size
        return self.table[b, :, :int(self.n_closed[b]) + int(has_open)]


def closed_page_meta(store, layer: int, plan: ForwardPlan) -> tuple[Tensor, Tensor, Tensor]:
    """K's per-channel minimum and scale of every request's closed pages, float [B, H, N, D]
    (N: the most closed pages of any request; a shorter request's rows are padded with its
    first page, which the selection ignores past its count), and the counts n_closed [B]."""
    p = store.page_size
    lay = store.layout_for(layer)
    if not lay.k.per_channel:
        raise ValueError("sparse decode scores pages from K's per-channel side tables: orientation 'channel_k' only")
    n_closed = (plan.seq_lens // p).to(torch.long)
    n = max(1, int(n_closed.max()))
    cols = torch.arange(n)
    ids = plan.page_table[:, :n] if plan.page_table.shape[1] >= n else torch.nn.functional.pad(
        plan.page_table, (0, n - plan.page_table.shape[1]))
    ids = torch.where(cols[None, :] < n_closed[:, None], ids, ids[:, :1]).to(store.device)
    buf = store.k_pages[layer]
    mn = lay.k.view(buf, "minimum")[ids].float().transpose(1, 2)  # [B, H, N, D]
    sc = lay.k.view(buf, "scale")[ids].float().transpose(1, 2)
    return mn, sc, n_closed


def select_for_decode(store, layer: int, plan: ForwardPlan, q: Tensor, cfg: SparseConfig) -> PageSelection | None:
    """The pages a decode step of `plan` reads at `layer` under `cfg`, for queries q [B, Hq, D]
    (scaled or not: the ranking is the same). None when no request has more closed pages than
    the budget (every page is read: dense decode)."""
    if not plan.is_decode:
        raise ValueError("sparse selection is for decode steps (one new token per request)")
    p = store.page_size
    h = store.num_heads
    n_closed = (plan.seq_lens // p).to(torch.long)
    if int(n_closed.max()) <= cfg.budget_pages(p):
        return None
    mn, sc, n_closed = closed_page_meta(store, layer, plan)
    b, hq, d = q.shape
    qg = q.float().reshape(b, h, hq // h, d).to(mn.device)
    bits = store.layout_for(layer).k.bits
    index, count = select(qg, mn, sc, bits, n_closed, cfg, p)
    return _as_table(plan, index, count, n_closed, p)


def _as_table(plan: ForwardPlan, index: Tensor, count: Tensor, n_closed: Tensor, p: int) -> PageSelection:
    """The selection as the kernels' per-head page table: each row's count[b] closed pages,
    then the open page's position (read from the tail; listed so positions stay complete)."""
    b, h, w = index.shape
    positions = torch.zeros(b, h, w + 1, dtype=torch.long)
    positions[:, :, :w] = index
    cols = torch.arange(w + 1)
    at_open = cols[None, None, :] == count[:, None, None]
    positions = torch.where(at_open, n_closed[:, None, None], positions)
    past = cols[None, None, :] > count[:, None, None]
    positions = positions.masked_fill(past, 0)
    last = (plan.num_pages.to(torch.long) - 1).clamp(min=0)
    lookup = torch.minimum(positions, last[:, None, None])
    table = torch.gather(plan.page_table.to(torch.long)[:, None, :].expand(b, h, -1), 2, lookup)
    seq = count * p + (plan.seq_lens.to(torch.long) - n_closed * p)
    return PageSelection(page_size=p, positions=positions, table=table, n_closed=count.to(torch.long), seq_lens=seq,
                         resident=n_closed)


class SparseDecode:
    """The selection of one forward pass across its layers: each sparse layer selects from its
    own queries, or reuses the selection of the layer before it (SparseConfig.share_layers,
    MPCache's layer-wise index sharing: page ids name the same tokens in every layer). Counts
    what was read for the metrics (pages selected and resident, summed over layers and heads)."""

    def __init__(self, cfg: SparseConfig) -> None:
        self.cfg = cfg
        self._plan: ForwardPlan | None = None
        self._last: PageSelection | None = None
        self._reuse_left = 0
        self.selections = 0  # selections computed (the rest were shared)
        self.pages_read = 0  # closed pages read over sparse layers and requests, per KV head
        self.pages_resident = 0  # closed pages a dense step would have read there

    @property
    def last(self) -> PageSelection | None:
        """The selection the latest sparse layer read (None: every page)."""
        return self._last

    def select(self, store, layer: int, plan: ForwardPlan, q: Tensor) -> PageSelection | None:
        """The pages this layer's decode reads (None: all), after the layer's store step."""
        if plan is self._plan and self._reuse_left > 0:
            self._reuse_left -= 1
            sel = self._last
        else:
            sel = select_for_decode(store, layer, plan, q, self.cfg)
            self._plan, self._last, self._reuse_left = plan, sel, self.cfg.share_layers - 1
            self.selections += 1
        resident = int((plan.seq_lens // store.page_size).sum())
        self.pages_resident += resident
        self.pages_read += resident if sel is None else int(sel.n_closed.sum())
        return sel
