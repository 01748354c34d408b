"""Copies of each running request's K side tables, in page order, for the compiled selection.

The one-level selection reads every closed page's K minimum and scale (2 x heads x head_dim
values) where the pool keeps them: inside each page, pages scattered over the pool, so a decode
step's selection gathers from hundreds of places. A served layer starts from cold caches (the
weights and the other layers went through them), and there that gather, not the arithmetic, is
what the selection waits on. A closed page never changes while its request holds it, so its
side tables are copied once, when it closes, into one buffer per (request, layer) in page order:
a step then streams that buffer (hack_select.c reads it through `copies`).

Entries are kept and dropped as hack_ops.paged.request_cache says. Memory, outside the KV pool:
per request and sparse layer, its closed pages' K side tables a second time (2 x heads x
head_dim x 2 bytes a page: SmolLM2 768 B against its 7.7 KB K and V page, ~10%; 7% where K and V
take 4 bits), plus room for the pages still to close (a quarter more, at least 16 pages). A new
request whose page table agrees with a running request's copy on most of its closed pages (a
cached prefix: SHARE_MIN) reads that copy for them and its own pages past it in place, until those
outgrow half the share; so a prefix many requests share is copied once, and read once from memory
by all of them. The copies are capped (`max_bytes`; a server sets what copying every page of its
pool once would take, `pool_bytes`): a request whose copy would pass the cap has its side tables
read in its pages, as without copies. The selection reads the same values, so it chooses the same
pages with or without the copies.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .plan import ForwardPlan
from .request_cache import RequestPageCache


# a copy grows by a quarter, at least this many pages (a decoding request closes one every
# partition_size tokens): the memory it holds ahead stays small, its re-copies rare
GROW_PAGES = 16
# a new request shares another's copy when their page tables agree on at least this share of its
# closed pages (a cached prefix), and keeps sharing while its own pages past it, read in place,
# stay under half the shared ones (else it makes its own copy)
SHARE_MIN = 2 / 3


@dataclass
class _Copy:
    """One buffer of side tables in page order, per layer."""

    ids: Tensor  # long [pages]: the page ids copied (positions 0..pages-1), by any layer
    rows: dict[int, Tensor] = field(default_factory=dict)  # layer -> uint8 [cap, copy_bytes]
    held: dict[int, int] = field(default_factory=dict)  # layer -> closed pages copied


@dataclass
class _Entry:
    ids: Tensor  # long: the request's page ids the entry stands for (RequestPageCache checks them)
    copy: _Copy | None = None
    limit: int | None = None  # None: the request's own copy, grown with it; else its first `limit` pages


def copy_bytes(store, layer: int) -> int:
    """Bytes of one page's copy: every head's K minimum, then every head's K scale."""
    k = store.layout_for(layer).k
    return k.minimum.nbytes + k.scale.nbytes


def pool_bytes(store) -> int:
    """What copying every page of the store once, in every layer, takes."""
    return store.num_pages * sum(copy_bytes(store, layer) for layer in range(store.num_layers))


class SideTableCopies(RequestPageCache[_Entry]):
    """Every running request's closed pages' K side tables per layer, contiguous."""

    def __init__(self, max_bytes: int | None = None) -> None:
        """max_bytes: the most the copies may hold (None: no cap)."""
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be non-negative, got {max_bytes}")
        super().__init__()
        self.max_bytes = max_bytes
        self.copied = 0  # (page, layer) side tables copied over the cache's life
        self.refused = 0  # (request, layer) selections read in the pages because of the cap
        self.shared = 0  # requests that took another's copy of their prefix
        self._full: ForwardPlan | None = None  # the forward in which the cap was met (no more growth)
        # what nbytes says and the entries' version it was summed at (None: a buffer grew since)
        self._nbytes: tuple[int, int] | None = None
        # per layer, pointers()'s last answer and what it was for (the entries' version, the
        # requests' closed pages, the store): a decode step whose requests closed no page since
        # the last one gets the same answer without a Python pass over its requests
        self._answers: dict[int, tuple] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held (capacity, every copy and layer; a shared copy once). Summed again only
        after entries changed (the version) or a buffer grew: a server reads it after every
        selection."""
        if self._nbytes is None or self._nbytes[0] != self.version:
            copies = {id(e.copy): e.copy for e in self._entries.values() if e.copy is not None}
            self._nbytes = (self.version, sum(t.numel() for c in copies.values() for t in c.rows.values()))
        return self._nbytes[1]

    def pointers(self, store, layer: int, plan: ForwardPlan, closed: list[int]
                 ) -> tuple[ctypes.Array, ctypes.Array, int]:
        """For the forward begun with plan: each request's copy at `layer` (copied here where
        missing), as the kernel takes them: base addresses (0: none, every page read in place),
        how many of the request's first closed pages each holds (a shared copy: the shared
        prefix; the rest are read in place), and the bytes between two pages' copies. The
        buffers stay alive while the cache holds the entries (until the next begin)."""
        if plan is not self._plan:
            self.begin(plan)
        last = self._answers.get(layer)
        if last is not None and last[0] == self.version and last[1] is store and last[2] == closed:
            self.refused += last[3]  # (over the cap: as often refused as when it was answered)
            return last[4]
        refused = self.refused
        width = copy_bytes(store, layer)
        n = len(closed)
        ptrs, held = (ctypes.c_int64 * n)(), (ctypes.c_int64 * n)()
        for b, key in enumerate(self._keys):
            want = int(closed[b])
            if want <= 0:
                continue
            e = self._entries.get(key)
            if e is None:
                e = self._entries[key] = _Entry(ids=torch.empty(0, dtype=torch.long))
            if e.copy is None or (e.limit is not None and want - e.limit > max(GROW_PAGES, e.limit // 2)):
                self._place(plan, b, e, want)
            upto = want if e.limit is None else e.limit
            rows = self._extend(store, layer, plan, b, e.copy, upto, width)
            if rows is None:  # over the cap: this request's side tables are read in its pages
                self.refused += 1
                continue
            if e.limit is None:  # the pages the entry stands for: its own copy's
                e.ids = e.copy.ids
            ptrs[b], held[b] = rows.data_ptr(), upto
        self._answers[layer] = (self.version, store, list(closed), self.refused - refused, (ptrs, held, width))
        return ptrs, held, width

    def _place(self, plan: ForwardPlan, b: int, e: _Entry, want: int) -> None:
        """Gives entry e (request b, `want` closed pages) a copy: the share of another request's
        where their tables agree on a cached prefix (SHARE_MIN of its pages, found only for a new
        entry), else its own."""
        self.version += 1  # (a copy it leaves may have been its last holder's: nbytes is summed again)
        best, lcp = None, 0
        if e.copy is None:
            row = plan.page_table[b, :want].to(torch.long)
            seen: set[int] = set()
            for other in self._entries.values():
                c = other.copy
                if c is None or other.limit is not None or id(c) in seen:
                    continue  # only own copies are shared (a shared one ends at its owner's pages)
                seen.add(id(c))
                m = min(int(c.ids.numel()), want)
                if m <= lcp:
                    continue
                differ = (c.ids[:m] != row[:m]).nonzero()
                agree = m if differ.numel() == 0 else int(differ[0, 0])
                if agree > lcp:
                    best, lcp = c, agree
        if best is not None and lcp >= SHARE_MIN * want:
            e.copy, e.limit = best, lcp
            e.ids = plan.page_table[b, :lcp].to(torch.long).clone()
            self.shared += 1
        else:
            e.copy, e.limit = _Copy(ids=torch.empty(0, dtype=torch.long)), None
            e.ids = torch.empty(0, dtype=torch.long)

    def _extend(self, store, layer: int, plan: ForwardPlan, b: int, c: _Copy, pages: int, width: int
                ) -> Tensor | None:
        """Copy c at `layer`, grown to hold request b's first `pages` closed pages (c's own
        request, or one sharing its first `pages`; None: that would pass the cap)."""
        have = c.held.get(layer, 0)
        rows = c.rows.get(layer)
        if have >= pages:
            return rows
        if rows is None or rows.shape[0] < pages:
            cap = max(pages + GROW_PAGES, (0 if rows is None else rows.shape[0]) * 5 // 4)
            if self.max_bytes is not None:
                if self._full is plan:
                    return None
                if self.nbytes + (cap - (0 if rows is None else rows.shape[0])) * width > self.max_bytes:
                    self._full = plan
                    return None
            grown = torch.empty(cap, width, dtype=torch.uint8)
            if rows is not None and have:
                grown[:have] = rows[:have]
            rows = c.rows[layer] = grown
            self._nbytes = None
        k = store.layout_for(layer).k
        mn, sc = k.minimum, k.scale
        ids = plan.page_table[b, have:pages].to(torch.long)
        buf = store.k_pages[layer]  # [num_pages, page_bytes] uint8
        rows[have:pages, :mn.nbytes] = buf[:, mn.offset:mn.offset + mn.nbytes][ids]
        rows[have:pages, mn.nbytes:] = buf[:, sc.offset:sc.offset + sc.nbytes][ids]
        c.held[layer] = pages
        self.copied += pages - have
        if c.ids.numel() < pages:
            c.ids = plan.page_table[b, :pages].to(torch.long).clone()
        return rows
