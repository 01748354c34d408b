"""Building page tables and filling a store with given K/V, for tests and benchmarks.

`scattered_table` lays requests out on pages in a shuffled order (as a long-running pool does),
so every reader must follow the page table rather than assume contiguity.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .plan import ForwardPlan
from .store import HackKVStore


def scattered_table(lengths: list[int], page_size: int, num_rows: int, rows: list[int], num_pages: int,
                    max_tokens: int | None = None, generator: torch.Generator | None = None,
                    first_page: int = 1) -> Tensor:
    """req_to_token [num_rows, max_tokens] int32 giving request i (in row rows[i]) enough pages
    for lengths[i] tokens, pages drawn in random order from first_page..num_pages-1."""
    p = page_size
    need = [-(-n // p) for n in lengths]
    if sum(need) > num_pages - first_page:
        raise ValueError(f"{sum(need)} pages needed, {num_pages - first_page} available")
    width = max_tokens or max(need) * p
    table = torch.zeros(num_rows, width, dtype=torch.int32)
    order = torch.randperm(num_pages - first_page, generator=generator) + first_page
    used = 0
    for row, n, k in zip(rows, lengths, need):
        pages = order[used:used + k]
        used += k
        slots = (pages[:, None] * p + torch.arange(p)[None, :]).flatten()
        table[row, : k * p] = slots.to(torch.int32)[: width]
    return table


def write_context(store: HackKVStore, req_to_token: Tensor, rows: list[int], k: list[Tensor], v: list[Tensor],
                  chunk: int = 4096) -> ForwardPlan:
    """Store whole contexts (k[i], v[i]: [len_i, H, D]) for every layer, in chunks, without
    attention (as a decode server does when pages arrive). Returns the last chunk's plan."""
    done = [0] * len(rows)
    plan = None
    while any(d < x.shape[0] for d, x in zip(done, k)):
        act = [i for i in range(len(rows)) if done[i] < k[i].shape[0]]
        ext = [min(chunk, k[i].shape[0] - done[i]) for i in act]
        plan = store.plan(req_to_token, [rows[i] for i in act], [done[i] + e for i, e in zip(act, ext)], ext)
        kk = torch.cat([k[i][done[i]:done[i] + e] for i, e in zip(act, ext)])
        vv = torch.cat([v[i][done[i]:done[i] + e] for i, e in zip(act, ext)])
        for layer in range(store.num_layers):
            store.write(layer, plan, kk, vv)
        for i, e in zip(act, ext):
            done[i] += e
    return plan
