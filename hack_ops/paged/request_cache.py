"""What the sparse selection keeps per running request across decode steps, and when it is stale.

A closed page never changes while its request holds it, so what is derived from a request's
closed pages (group boxes, copies of their side tables) is computed once and kept, keyed by
SGLang's request id where the forward carries it, else by the request's row. Each forward keeps
only the entries of its own requests whose recorded page ids are still a prefix of the request's
page table (a request retracted and re-admitted, or a row reused, starts over); an extend
forward drops its requests' entries (`forget`).
"""
from __future__ import annotations

from typing import Generic, Hashable, Protocol, TypeVar

import torch
from torch import Tensor

from .plan import ForwardPlan


def request_keys(rows: list[int], keys: list[Hashable] | None) -> list[Hashable]:
    """The cache's key of each request: its id where the forward names it, else its row."""
    return [("row", int(r)) for r in rows] if keys is None else list(keys)


class _HasIds(Protocol):
    ids: Tensor  # long [pages]: the page ids the entry was derived from (positions 0..pages-1)


E = TypeVar("E", bound=_HasIds)


class RequestPageCache(Generic[E]):
    """Entries per running request, each valid while its page ids prefix the request's table."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, E] = {}
        self._plan: ForwardPlan | None = None
        self._keys: list[Hashable] = []
        self.version = 0  # bumped whenever the set of entries changes (what derived caches check)

    def __len__(self) -> int:
        return len(self._entries)

    def begin(self, plan: ForwardPlan, keys: list[Hashable] | None = None) -> None:
        """A forward over plan's requests (keys: one per request, e.g. SGLang's rids; None: the
        rows): keep only their entries, each still naming the pages it was derived from."""
        if plan is self._plan:
            return
        rows = plan.rows.tolist()
        keys = request_keys(rows, keys)
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} request keys for a forward of {len(rows)} requests")
        kept: dict[Hashable, E] = {}
        for b, key in enumerate(keys):
            e = self._entries.get(key)
            if e is None:
                continue
            n = int(e.ids.numel())
            if n <= plan.page_table.shape[1] and int(plan.num_pages[b]) >= n \
                    and torch.equal(plan.page_table[b, :n].to(torch.long), e.ids):
                kept[key] = e
        if keys != self._keys or len(kept) != len(self._entries):
            self.version += 1
        self._entries, self._plan, self._keys = kept, plan, keys

    def forget(self, rows: list[int], keys: list[Hashable] | None = None) -> None:
        """Drops these requests' entries (their rows, and their ids where known): an extend
        forward is storing new tokens for them (a new request that reuses an id, or one coming
        back after it was retracted)."""
        for key in request_keys(rows, keys):
            self._entries.pop(key, None)
        self._plan = None
        self.version += 1
