"""Sparse decode: which closed pages a decode step reads, scored from the K pages' own side tables.

MPCache's query-aware dynamic selection (seed 003) and Quest's per-page bound, on HACK pages.
With K quantized per channel over a page ('channel_k'), channel c of every key the page holds
is min_c + code * scale_c with code in 0..L (L = 2^bits - 1, scale >= 0), so for a query q

    max over the page's keys of q.k  <=  sum_c max(q_c min_c, q_c (min_c + L scale_c))
                                      =  q.min + L * relu(q).scale                  (PageScore.BOUND)

an upper bound of every score the page can give to the keys attention reads (the quantized
ones), from two dot products per page and no metadata beyond the page's own. MPCache's
stand-in (PageScore.LINEAR) replaces the per-channel max by alpha * max + (1 - alpha) * min
with alpha = 0.6: q.min + alpha * L * q.scale, one dot product.

A page's score for a KV head is the max over the query heads of its GQA group (the bound must
hold for every head that reads the page; averaging the queries first, as SGLang's Quest port
does, breaks it). Selection keeps, per (request, KV head): the first page (it holds the
attention sinks), the most recent `recent_tokens` worth of closed pages, and the best-scored
rest up to `budget_tokens` of closed pages; the open partition (the FP16 tail) is always read.
Every head of a request reads the same number of pages, each its own.

Refinement (`refine` R > 1): the bound keeps R times the free slots' pages as candidates, and
the slots go to the candidates whose best score over their own keys (max over the page's
quantized keys and the group's query heads of q.k) is highest. The bound is an upper bound:
a page whose box reaches high in every channel outranks the one page that holds what the query
looks for (measured: SmolLM2's pass-key page read at 88% of a 1K budget's steps, 96% refined
twice, 99% four times; docs/sparse.md); its own keys tell them apart at the cost of reading the
candidates' K codes.

Two levels (`group_pages` > 0, MPCache's hierarchical clustering): groups of that many
consecutive pages are scored first by the same bound over the group's box (the min of the
pages' minimums, the max of their maximums), the best groups are kept (`group_keep` of the
budget's pages, in groups), and pages are chosen among theirs.

Semantics, which the paged kernels keep: a sparse decode step is the ordinary decode of a
shorter sequence made of the selected whole pages in position order, then the open partition
(`gather_sequence`). Pages stay whole and aligned, so each is quantized exactly as it was;
positions inside the shorter sequence do not matter to decode (every closed key is visible,
and sliding-window layers are never sparse: their window already bounds what they read).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor

LINEAR_ALPHA = 0.6  # MPCache's alpha (its section 4.3, chosen empirically there)


class PageScore(StrEnum):
    BOUND = "bound"  # the exact upper bound of q.k over the page (q.min + L relu(q).scale)
    LINEAR = "linear"  # MPCache's linear stand-in, q.(alpha max + (1 - alpha) min)


@dataclass(frozen=True)
class SparseConfig:
    """budget_tokens: closed-page tokens each (request, KV head) reads per decode step (a
    multiple of the page size is what counts; 0 = sparse decode off). recent_tokens: the most
    recent closed tokens always read (a local window, within the budget). dense_layers: the
    first layers read every page (their attention is broad: Quest and MPCache keep them dense).
    share_layers: a selection is reused by the next share_layers - 1 sparse layers (MPCache's
    layer-wise index sharing; 1 = every layer selects its own). group_pages / group_keep: the
    two-level selection (0 = one level). refine: candidates per free slot that the bound keeps for
    the pages' own keys to choose from (1 = the bound alone)."""

    budget_tokens: int = 0
    recent_tokens: int = 256
    dense_layers: int = 2
    share_layers: int = 1
    score: PageScore = PageScore.BOUND
    group_pages: int = 0
    group_keep: float = 2.0  # groups kept = ceil(group_keep * budget pages / group_pages), beside the first and recent ones
    refine: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "score", PageScore(self.score))
        for name in ("budget_tokens", "recent_tokens", "dense_layers", "group_pages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        for name in ("share_layers", "refine"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not self.group_keep >= 1.0:
            raise ValueError(f"group_keep must be >= 1 (groups holding at least the budget), got {self.group_keep!r}")

    @property
    def enabled(self) -> bool:
        return self.budget_tokens > 0

    def budget_pages(self, page_size: int) -> int:
        """Closed pages read per (request, KV head): the budget in whole pages, at least the
        first page and one more."""
        return max(2, self.budget_tokens // page_size)

    def recent_pages(self, page_size: int) -> int:
        return -(-self.recent_tokens // page_size) if self.recent_tokens else 0

    def keep_groups(self, page_size: int) -> int:
        """Groups a two-level selection keeps per (request, KV head): group_keep x the budget's
        pages in groups, plus the first group and the recent pages' groups."""
        budget, g = self.budget_pages(page_size), self.group_pages
        recent_groups = -(-min(self.recent_pages(page_size), budget - 1) // g) + 1
        return -(-int(self.group_keep * budget) // g) + 1 + recent_groups

    def layer_is_sparse(self, layer: int, window: int | None) -> bool:
        return self.enabled and layer >= self.dense_layers and window is None


def page_scores(q: Tensor, minimum: Tensor, scale: Tensor, bits: int, score: PageScore | str = PageScore.BOUND) -> Tensor:
    """Scores of pages for a GQA group: q [..., R, D] (the group's R query heads), the pages'
    per-channel K minimum and scale [..., n, D] (float; scale >= 0) -> [..., n], the max over
    the R heads of PageScore `score` (the upper bound of q.k over each page by default)."""
    q, minimum, scale = q.float(), minimum.float(), scale.float()
    levels = float((1 << bits) - 1)
    s = q @ minimum.transpose(-1, -2)  # [..., R, n]
    if PageScore(score) == PageScore.BOUND:
        s = s + levels * (q.clamp(min=0) @ scale.transpose(-1, -2))
    else:
        s = s + (LINEAR_ALPHA * levels) * (q @ scale.transpose(-1, -2))
    return s.amax(-2)


def group_boxes(minimum: Tensor, scale: Tensor, bits: int, group: int) -> tuple[Tensor, Tensor]:
    """Per-channel boxes of groups of `group` consecutive pages ([..., n, D] -> [..., ceil(n/group), D]),
    as (minimum, scale) of the same form as a page's, so page_scores bounds a group too: the
    group's minimum is its pages' smallest, its top (minimum + L * scale) their largest."""
    levels = float((1 << bits) - 1)
    n = minimum.shape[-2]
    pad = -n % group
    top = minimum + levels * scale
    if pad:  # repeat the last page: it changes no box
        minimum = torch.cat([minimum, minimum[..., -1:, :].expand(*minimum.shape[:-2], pad, minimum.shape[-1])], -2)
        top = torch.cat([top, top[..., -1:, :].expand(*top.shape[:-2], pad, top.shape[-1])], -2)
    shape = (*minimum.shape[:-2], (n + pad) // group, group, minimum.shape[-1])
    gmin = minimum.reshape(shape).amin(-2)
    gtop = top.reshape(shape).amax(-2)
    return gmin, (gtop - gmin) / levels


def select_pages(scores: Tensor, n_closed: Tensor, budget: int, recent_from: Tensor,
                 width: int | None = None) -> tuple[Tensor, Tensor]:
    """The closed pages each (request, KV head) reads. scores [B, H, N] (N >= every n_closed;
    entries at or past a request's n_closed are ignored), n_closed [B], budget: pages per
    (request, head), recent_from [B]: the first recent position kept whatever its score (like
    the first page). Returns (index [B, H, W] long, ascending positions, W = max count; count
    [B]): request b's heads each read count[b] = min(n_closed[b], budget) pages,
    index[b, h, :count[b]]; the rest of a row is padding (positions past the request's pages).
    Both on the scores' device. width: W when the caller knows it on the host (the GPU path, so
    nothing is read back from the device); it must equal max(count)."""
    b, h, n = scores.shape
    dev = scores.device  # the GPU path selects where its pages are (hack_ops.triton.sparse)
    n_closed = n_closed.to(device=dev, dtype=torch.long)
    pos = torch.arange(n, device=dev)
    valid = pos[None, :] < n_closed[:, None]  # [B, N]
    keep = valid & ((pos[None, :] == 0) | (pos[None, :] >= recent_from.to(device=dev, dtype=torch.long)[:, None]))
    s = scores.float().masked_fill(~valid[:, None, :], float("-inf"))
    s = s.masked_fill(keep[:, None, :], float("inf"))
    count = torch.clamp(n_closed, max=budget)
    w = (int(count.max()) if b else 0) if width is None else width
    if w == 0:
        return torch.zeros(b, h, 0, dtype=torch.long, device=dev), count
    # kept pages first (+inf), padding last (-inf): a request with fewer pages than w picks
    # padding positions, which sort after its own, so its count[b] leading entries are its pages
    idx = torch.topk(s, w, dim=-1).indices
    return torch.sort(idx, dim=-1).values, count


def page_best(q: Tensor, keys: Tensor, page_size: int) -> Tensor:
    """Each page's best score: q [..., R, D], keys [..., N * page_size, D] (the pages' keys as
    attention reads them) -> [..., N], the max over the R query heads and the page's keys of q.k."""
    s = q.float() @ keys.float().transpose(-1, -2)  # [..., R, N * P]
    return s.reshape(*s.shape[:-1], -1, page_size).amax(-1).amax(-2)


# Below every candidate's score, above the padding's -inf (select_pages never picks it as padding).
_NOT_CANDIDATE = -1e30


def refine_scores(scores: Tensor, best: Tensor, n_closed: Tensor, budget: int, recent_from: Tensor,
                  refine: int) -> Tensor:
    """Scores [B, H, N] for select_pages after refinement: among the pages between the first and
    the recent ones, the `refine` x free-slots best by `scores` (the bound) take their `best`
    (page_best), the rest rank below all of them."""
    b, h, n = scores.shape
    n_closed = n_closed.to(torch.long).cpu()
    rf = recent_from.to(torch.long).cpu().clamp(min=1)
    pos = torch.arange(n)
    middle = (pos[None, :] >= 1) & (pos[None, :] < torch.minimum(rf, n_closed)[:, None])  # [B, N]
    kept = (n_closed > 0).to(torch.long) + (n_closed - torch.minimum(rf, n_closed))
    free = (torch.clamp(n_closed, max=budget) - kept).clamp(min=0)  # [B]
    cand = (refine * free).clamp(max=n)
    s = scores.float().cpu().masked_fill(~middle[:, None, :], float("-inf"))
    order = torch.argsort(s, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, pos.expand(b, h, n).contiguous())
    # a page the bound ruled out (-inf: outside the kept groups of a two-level selection) is no candidate
    is_cand = (rank < cand[:, None, None]) & middle[:, None, :] & (s > float("-inf"))
    out = torch.where(is_cand, best.float().cpu(), torch.full_like(s, _NOT_CANDIDATE))
    return torch.where(middle[:, None, :], out, scores.float().cpu())


def kept_group_pages(q: Tensor, minimum: Tensor, scale: Tensor, bits: int, n_closed: Tensor, cfg: SparseConfig,
                     page_size: int) -> Tensor:
    """The first level of a two-level selection (cfg.group_pages pages a group): bool [B, H, N],
    True for the pages of the groups kept per (request, KV head): the first group, the recent
    pages' groups and the best of the rest by the bound over each group's box, group_keep x the
    budget's pages in all. Arguments as select's."""
    g = cfg.group_pages
    n_closed = n_closed.to(torch.long).cpu()
    budget = cfg.budget_pages(page_size)
    recent_from = n_closed - min(cfg.recent_pages(page_size), budget - 1)
    gmin, gscale = group_boxes(minimum, scale, bits, g)
    gscores = page_scores(q, gmin, gscale, bits, cfg.score)  # [B, H, G]
    # the best groups for the budget, beside the groups the first and the recent pages hold
    gidx, gcount = select_pages(gscores.cpu(), -(-n_closed // g), cfg.keep_groups(page_size),
                                recent_from.clamp(min=0) // g)
    kept = torch.zeros(gscores.shape, dtype=torch.bool)
    taken = torch.arange(gidx.shape[-1])[None, None, :] < gcount[:, None, None]
    kept.scatter_(-1, gidx, taken.expand(gidx.shape))
    return kept.repeat_interleave(g, -1)[..., :minimum.shape[-2]]


def select(q: Tensor, minimum: Tensor, scale: Tensor, bits: int, n_closed: Tensor, cfg: SparseConfig,
           page_size: int, best: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Selection of SparseConfig `cfg` for a batch: q [B, H, R, D] (the query heads of each KV
    head's group), the closed pages' K minimum and scale [B, H, N, D], n_closed [B]. One level,
    or two with cfg.group_pages: groups scored by the bound over their box first, the best
    (and the first, and the recent pages' ones) kept, then pages chosen among theirs. With
    cfg.refine > 1, `best` [B, H, N] holds each page's page_best, and the bound's candidates
    (among the kept groups' pages) are ranked by it. Returns select_pages' (index,
    count)."""
    n_closed = n_closed.to(torch.long).cpu()
    budget = cfg.budget_pages(page_size)
    recent_from = n_closed - min(cfg.recent_pages(page_size), budget - 1)  # the first page stays in
    scores = page_scores(q, minimum, scale, bits, cfg.score)  # [B, H, N]
    if cfg.refine > 1 and best is None:
        raise ValueError("a refined selection needs each page's best score over its own keys (page_best)")
    if cfg.group_pages and minimum.shape[-2] > cfg.group_pages:
        kept = kept_group_pages(q, minimum, scale, bits, n_closed, cfg, page_size)
        scores = scores.cpu().masked_fill(~kept, float("-inf"))
    if cfg.refine > 1:  # the candidates: the bound's best pages (of the kept groups, with two levels)
        scores = refine_scores(scores, best, n_closed, budget, recent_from, cfg.refine)
    return select_pages(scores.cpu(), n_closed, budget, recent_from)  # the reference's choice, on the CPU


def gather_sequence(x: Tensor, pages: Tensor, page_size: int) -> Tensor:
    """The shorter sequence a sparse decode step reads for one KV head: x [L, ...] (a
    sequence's K or V, positions 0..L-1), pages: the selected closed page positions
    (ascending). Returns the selected whole pages in order, then the open partition
    (positions from (L // page_size) * page_size)."""
    p = page_size
    nc = x.shape[0] // p
    parts = [x[int(i) * p:(int(i) + 1) * p] for i in pages.tolist()]
    return torch.cat([*parts, x[nc * p:]], 0)


def row_page_mask(q: Tensor, minimum: Tensor, scale: Tensor, bits: int, n_closed: Tensor, cfg: SparseConfig,
                  page_size: int, keys: Tensor | None = None) -> Tensor:
    """The pages each query row of a teacher-forced pass reads under sparse decode, as if every
    row were a decode step: q [B, H, R, Sq, D] (the R query heads of each KV head's group),
    the pages' K minimum and scale [B, H, N, D], n_closed [Sq] (closed pages of each row).
    Returns bool [B, H, Sq, N]: True for the closed pages the row's selection keeps and for
    every page at or past its n_closed (not closed: the caller's visibility decides there).
    One level only (the reference's; two levels are served, hack_ops.paged.sparse). With
    cfg.refine > 1, keys [B, H, N * page_size, D]: the closed pages' keys as attention reads them."""
    if cfg.group_pages:
        raise ValueError("the reference's per-row selection is one level; two-level selection runs on the paged path")
    b, h, r, sq, d = q.shape
    n = minimum.shape[-2]
    scores = page_scores(q.transpose(2, 3), minimum[:, :, None], scale[:, :, None], bits, cfg.score)  # [B, H, Sq, N]
    rows = scores.permute(0, 2, 1, 3).reshape(b * sq, h, n)
    nc = n_closed.to(torch.long).cpu().repeat(b)
    budget = cfg.budget_pages(page_size)
    recent_from = nc - min(cfg.recent_pages(page_size), budget - 1)
    if cfg.refine > 1:
        if keys is None:
            raise ValueError("a refined selection needs the closed pages' keys")
        best = page_best(q.transpose(2, 3), keys[:, :, None, :n * page_size], page_size)  # [B, H, Sq, N]
        rows = refine_scores(rows, best.permute(0, 2, 1, 3).reshape(b * sq, h, n), nc, budget, recent_from, cfg.refine)
    idx, count = select_pages(rows.cpu(), nc, budget, recent_from)
    keep = torch.zeros(b * sq, h, n, dtype=torch.bool)
    if idx.shape[-1]:
        taken = torch.arange(idx.shape[-1])[None, None, :] < count[:, None, None]
        keep.scatter_(-1, idx.clamp(max=n - 1), taken.expand(idx.shape).clone())
    keep |= torch.arange(n)[None, None, :] >= nc[:, None, None]
    return keep.reshape(b, sq, h, n).permute(0, 2, 1, 3)
