"""Look-once static eviction (MPCache's first step, seed 003): after a prompt's prefill, keep the
closed pages its last queries attend to and drop the rest for every later decode step.

The prompt's last `observe` fraction of queries (the observation window: for a question at the
end of a document, the question itself; measured, a window of 1% keeps the pass keys that one of
15%, MPCache's, loses, as the mean over hundreds of haystack rows drowns the question's) vote
with their exact attention: a page's vote for a KV head is the attention mass the group's query heads put on the page's keys, the max over the
group's heads (a page one head needs is needed), averaged over the window's rows. Per KV head
(KeepUnit.HEAD) each head keeps its own best pages; per page (KeepUnit.PAGE) a layer's page is
kept or dropped for all of its KV heads at once, by the max of their votes: a HACK page holds
every KV head of its layer (hack_ops.layout), so the page is the unit the PD wire and the pool
can leave out. Always kept: the first page (the attention sinks) and every closed page the
observation window reaches into (the window's own tokens). The open partition (the FP16 tail)
and every page written after the prompt are never dropped.

keep is the fraction of the prompt's closed pages kept per (layer, KV head) or per layer: at
keep 0.5 a decode step reads half of the prompt's closed pages, and PD sends half of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor

from .attention import soft_cap, visible


class KeepUnit(StrEnum):
    HEAD = "head"  # each KV head keeps its own pages (the finest a page-scored selection can be)
    PAGE = "page"  # a layer's page is kept for all its KV heads or dropped for all (what the wire can leave out)


@dataclass(frozen=True)
class StaticKeep:
    """keep: fraction of the prompt's closed pages kept (1 = nothing dropped). observe: the
    last fraction of the prompt whose queries vote (at least one row). unit: KeepUnit."""

    keep: float = 1.0
    observe: float = 0.01  # ~41 rows at 4K, the question itself; 0.15 (MPCache's) lost keys (docs/sparse.md)
    unit: KeepUnit = KeepUnit.PAGE

    def __post_init__(self) -> None:
        object.__setattr__(self, "unit", KeepUnit(self.unit))
        if not 0.0 < self.keep <= 1.0:
            raise ValueError(f"keep must be a fraction in (0, 1], got {self.keep!r}")
        if not 0.0 < self.observe <= 1.0:
            raise ValueError(f"observe must be a fraction in (0, 1], got {self.observe!r}")

    @property
    def enabled(self) -> bool:
        return self.keep < 1.0

    def observe_rows(self, prompt_len: int) -> int:
        """Rows of the observation window for a prompt of prompt_len tokens."""
        return max(1, min(prompt_len, math.ceil(self.observe * prompt_len)))

    def kept_count(self, n_closed: int) -> int:
        """Closed pages kept out of n_closed (before the forced pages are counted in)."""
        return min(n_closed, math.ceil(self.keep * n_closed))

    def label(self) -> str:
        return f"static keep {self.keep:g} ({self.unit.value})"


def page_votes(q: Tensor, k: Tensor, rows: Tensor, page_size: int, scale: float, logit_cap: float = 0.0) -> Tensor:
    """Each closed page's vote per KV head: q [H, R, m, D] (the R query heads of each KV head's
    group at the m observation rows), k [H, n, D] (the prompt's keys), rows [m] (the rows'
    positions, each < n). Returns float [H, n // page_size]: the attention mass on the page's
    keys (causal softmax over keys 0..row of each row), max over the R heads, mean over the rows."""
    n = k.shape[-2]
    s = soft_cap(q.float() @ k.float()[:, None].transpose(-1, -2) * scale, logit_cap)  # [H, R, m, n]
    s = s.masked_fill(~visible(torch.arange(n)[None, :], rows.to(torch.long)[:, None], None), float("-inf"))
    p = torch.softmax(s, -1)
    nc = n // page_size
    mass = p[..., :nc * page_size].reshape(*p.shape[:-1], nc, page_size).sum(-1)  # [H, R, m, N]
    return mass.amax(1).mean(1)


def keep_pages(votes: Tensor, first_observed: int, page_size: int, cfg: StaticKeep) -> Tensor:
    """The prompt's closed pages kept: votes [H, N] (page_votes), first_observed: the first
    observation row's position. Returns bool [H, N] (True = kept); with KeepUnit.PAGE every
    head's row is the same. The first page and the pages at or past the observation window's
    first row are kept whatever their vote; the best-voted rest fill cfg.kept_count(N)."""
    h, n = votes.shape
    if n == 0:
        return torch.zeros(h, 0, dtype=torch.bool)
    pos = torch.arange(n)
    forced = (pos == 0) | (pos >= first_observed // page_size)
    v = votes.float()
    if cfg.unit == KeepUnit.PAGE:
        v = v.amax(0, keepdim=True)
    v = v.masked_fill(forced[None, :], float("inf"))
    count = max(int(forced.sum()), cfg.kept_count(n))
    idx = torch.topk(v, count, dim=-1).indices
    kept = torch.zeros(v.shape, dtype=torch.bool).scatter_(-1, idx, True)
    return kept.expand(h, n).clone()


def keep_from_window(q_obs: Tensor, k: Tensor, page_size: int, cfg: StaticKeep, scale: float,
                     logit_cap: float = 0.0) -> Tensor:
    """keep_pages from the observation window's queries alone: q_obs [H, R, m, D], the window's
    rows, which are the last m positions of the n keys k [H, n, D] (a server has only these rows
    at hand after a prompt's last chunk). Returns bool [H, n // page_size]."""
    n, m = k.shape[-2], q_obs.shape[-2]
    if not 0 < m <= n:
        raise ValueError(f"the observation window holds {m} rows of a {n}-token prompt")
    votes = page_votes(q_obs, k, torch.arange(n - m, n), page_size, scale, logit_cap)
    return keep_pages(votes, n - m, page_size, cfg)


def keep_mask(q: Tensor, k: Tensor, prompt_len: int, page_size: int, cfg: StaticKeep, scale: float,
              logit_cap: float = 0.0) -> Tensor:
    """keep_pages for one layer of one request: q [H, R, >= prompt_len, D] and k [H, >= prompt_len, D]
    (positions from 0; only the prompt's are read). Returns bool [H, prompt_len // page_size]."""
    m = cfg.observe_rows(prompt_len)
    return keep_from_window(q[:, :, prompt_len - m:prompt_len], k[:, :prompt_len], page_size, cfg, scale, logit_cap)
