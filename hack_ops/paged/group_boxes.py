"""Cached group boxes for the two-level sparse selection (`--hack-sparse-groups PAGES`).

A group of PAGES consecutive closed pages is bounded by its box: per channel, the smallest
minimum and the largest top (minimum + L * scale) of its pages (hack_ops.sparse.group_boxes).
A closed page never changes while its request holds it, so a complete group's box is computed
once, when its last page has closed, and kept here per (request, layer); a decode step then
scores the boxes (a group's bound costs what a page's does) and only the pages of the best
groups, instead of every page (hack_select.c, `choose_two_level`).

Entries are kept and dropped as hack_ops.paged.request_cache says (a request that comes back
recomputes its boxes: one pass over its side tables). Memory: per request and layer, 2 x heads x groups x
head_dim floats (Llama-3-8B at 32K with groups of 8 pages: 0.5 MB a layer, ~2% of the request's
HACK pages), outside the KV pool.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..sparse import group_boxes
from .plan import ForwardPlan
from .request_cache import RequestPageCache


@dataclass
class _Entry:
    ids: Tensor  # long [pages]: the page ids the boxes were computed from (positions 0..pages-1)
    boxes: dict[int, Tensor] = field(default_factory=dict)  # layer -> float [H, cap, 2, D]
    groups: dict[int, int] = field(default_factory=dict)  # layer -> complete groups held


class GroupBoxCache(RequestPageCache[_Entry]):
    """The boxes of every running request's complete page groups, per layer."""

    def __init__(self, group_pages: int) -> None:
        if group_pages < 1:
            raise ValueError(f"group_pages must be positive, got {group_pages}")
        super().__init__()
        self.group_pages = group_pages
        self.computed = 0  # group boxes computed over the cache's life (the rest were reused)

    def pointers(self, store, layer: int, plan: ForwardPlan, need: list[int]) -> tuple[Tensor, Tensor, list]:
        """For the forward begun with plan: each request's boxes at `layer` holding at least
        need[b] complete groups (computed here where missing), as the kernel takes them: base
        pointers int64 [B] (0 where none is needed), capacities int64 [B], and the tensors they
        point into (keep them alive across the call)."""
        if plan is not self._plan:
            self.begin(plan)
        g = self.group_pages
        ptrs, caps, alive = [], [], []
        for b, key in enumerate(self._keys):
            want = int(need[b])
            if want <= 0:
                ptrs.append(0)
                caps.append(0)
                continue
            e = self._entries.get(key)
            if e is None:
                e = self._entries[key] = _Entry(ids=torch.empty(0, dtype=torch.long))
            box = self._extend(store, layer, plan, b, e, want * g)
            ptrs.append(box.data_ptr())
            caps.append(box.shape[1])
            alive.append(box)
        return torch.tensor(ptrs, dtype=torch.int64), torch.tensor(caps, dtype=torch.int64), alive

    def _extend(self, store, layer: int, plan: ForwardPlan, b: int, e: _Entry, pages: int) -> Tensor:
        """Entry e's boxes at `layer`, grown to cover its first `pages` closed pages."""
        g = self.group_pages
        have = e.groups.get(layer, 0)
        want = pages // g
        box = e.boxes.get(layer)
        if have >= want:
            return box
        lay = store.layout_for(layer)
        h, d = store.num_heads, store.head_dim
        if box is None or box.shape[1] < want:
            grown = torch.empty(h, max(want, 2 * (0 if box is None else box.shape[1])), 2, d, dtype=torch.float32)
            if box is not None and have:
                grown[:, :have] = box[:, :have]
            box = e.boxes[layer] = grown
        ids = plan.page_table[b, have * g:want * g].to(torch.long)
        buf = store.k_pages[layer]
        mn = lay.k.view(buf, "minimum")[ids.to(buf.device)].float().transpose(0, 1).cpu()  # [H, n, D]
        sc = lay.k.view(buf, "scale")[ids.to(buf.device)].float().transpose(0, 1).cpu()
        gmin, gscale = group_boxes(mn, sc, lay.k.bits, g)
        box[:, have:want, 0] = gmin
        box[:, have:want, 1] = gscale
        e.groups[layer] = want
        self.computed += want - have
        if e.ids.numel() < want * g:
            e.ids = plan.page_table[b, :want * g].to(torch.long).clone()
        return box
