"""A request's KV state taken out of the store and put back elsewhere (SGLang's retraction backup on
a PD decode server: `--disaggregation-decode-retraction-backup cpu_tensor` copies a retracted
request's KV to host memory, frees its slots and row, and loads the copy into whatever slots and
row the request gets when it resumes).

A request's state in a HACK store is three things, all moved here: the bytes of its pages (every
layer, codes, side tables and code sums; the open page too, whose bytes hold what a tensor without
a tail stores per token), the first `tokens % Π` FP16 rows of its tails (the open partition), and
its sinks, keyed by its first page (restored under the new first page's slot). Nothing else in the
store depends on where a request lives.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .store import HackKVStore


@dataclass
class RequestCopy:
    """What `save` took of one request: `tokens` KV tokens, on the CPU."""

    tokens: int
    k_pages: list[Tensor]  # per layer [pages, k page bytes]
    v_pages: list[Tensor]  # per layer [pages, v page bytes]
    tails: dict[str, list[Tensor]]  # tensor name -> per layer [open tokens, heads, head_dim]
    sink_k: list[Tensor] | None  # per layer [sink tokens, heads, head_dim]; None: no sinks held
    sink_v: list[Tensor] | None

    def tensors(self) -> list[Tensor]:
        """Every tensor of the copy in one fixed order: per layer K pages, V pages, the open
        rows of each tail (by name), then the sinks. `to_bytes` and `from_bytes` agree on it."""
        out: list[Tensor] = []
        for layer in range(len(self.k_pages)):
            out += [self.k_pages[layer], self.v_pages[layer]]
            out += [self.tails[name][layer] for name in sorted(self.tails)]
            if self.sink_k is not None:
                out += [self.sink_k[layer], self.sink_v[layer]]
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to_bytes(self) -> bytes:
        """The copy as one byte string (what a page tier writes; shapes come from the store)."""
        return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in self.tensors())

    @classmethod
    def from_bytes(cls, store: HackKVStore, tokens: int, data: bytes | bytearray | memoryview) -> "RequestCopy":
        """The copy `to_bytes` wrote of a `tokens`-token request of a store laid out as `store`;
        ValueError when the byte count is not that layout's (with sinks or without)."""
        pages = -(-tokens // store.page_size)
        open_tokens = tokens % store.page_size
        heads, dim = store.num_heads, store.head_dim
        k = [torch.empty((pages, *b.shape[1:]), dtype=b.dtype) for b in store.k_pages]
        v = [torch.empty((pages, *b.shape[1:]), dtype=b.dtype) for b in store.v_pages]
        tails = {name: [torch.empty((open_tokens, *t.shape[2:]), dtype=t.dtype) for t in ts]
                 for name, ts in store.tails.items()}
        sinks = store.num_sink_slots and tokens
        sink_k = [torch.empty(t.shape[1:], dtype=t.dtype) for t in store.sink_k] if sinks else None
        sink_v = [torch.empty(t.shape[1:], dtype=t.dtype) for t in store.sink_v] if sinks else None
        copy = cls(tokens, k, v, tails, sink_k, sink_v)
        raw = np.frombuffer(data, dtype=np.uint8)
        if len(raw) != copy.nbytes and sinks:  # saved while the request held no sink slot
            copy = cls(tokens, k, v, tails, None, None)
        if len(raw) != copy.nbytes:
            raise ValueError(f"the stored request holds {len(raw):,} bytes; a {tokens}-token request of this "
                             f"layout ({heads} KV heads x {dim}) holds {copy.nbytes:,}")
        off = 0
        for t in copy.tensors():
            nb = t.numel() * t.element_size()
            t.view(torch.uint8).view(-1).numpy()[:] = raw[off:off + nb]
            off += nb
        return copy


def _pages(store: HackKVStore, token_slots: Tensor) -> Tensor:
    """The page ids holding `token_slots` (a request's slots in order, page-aligned runs)."""
    slots = torch.as_tensor(token_slots).reshape(-1).to(torch.long).cpu()
    if slots.numel() == 0:
        return slots
    p = store.page_size
    pages = slots[::p] // p
    if int(pages.max()) >= store.num_pages or int(pages.min()) < 0:
        raise ValueError(f"token slots refer to pages outside the store's {store.num_pages}")
    n = slots.numel()
    if not (torch.equal(slots // p, pages.repeat_interleave(p)[:n]) and torch.equal(slots % p, torch.arange(n) % p)):
        raise ValueError("a request's token slots must fill whole pages in order (SGLang's paged allocator)")
    return pages


def _host(t: Tensor) -> Tensor:
    """A copy on the CPU (`.cpu()` of a CPU tensor is the tensor itself: a view of the store)."""
    return t.to("cpu", copy=True)


def _row(store: HackKVStore, row: int) -> int:
    row = int(row)
    if not 0 <= row < store.num_rows:
        raise ValueError(f"request row {row} is outside the store's {store.num_rows} rows")
    return row


@torch.no_grad()
def save(store: HackKVStore, token_slots: Tensor, row: int) -> RequestCopy:
    """Copy the state of the request whose KV tokens sit at `token_slots`, open page in tail row
    `row`, to the CPU (the store is not changed: freeing the slots is the caller's)."""
    pages = _pages(store, token_slots)
    n = int(torch.as_tensor(token_slots).numel())
    open_tokens = n % store.page_size
    row = _row(store, row)
    dev = pages.to(store.device)
    k = [_host(buf[dev]) for buf in store.k_pages]
    v = [_host(buf[dev]) for buf in store.v_pages]
    tails = {name: [_host(t[row, :open_tokens]) for t in ts] for name, ts in store.tails.items()}
    sink_k = sink_v = None
    if n and store.num_sink_slots:
        slot = int(store.sink_map[int(pages[0])])
        if slot >= 0:
            sink_k = [_host(t[slot]) for t in store.sink_k]
            sink_v = [_host(t[slot]) for t in store.sink_v]
    return RequestCopy(n, k, v, tails, sink_k, sink_v)


@torch.no_grad()
def load(store: HackKVStore, copy: RequestCopy, token_slots: Tensor, row: int) -> None:
    """Put `copy` back at `token_slots` (as many tokens as were saved) with its open page in tail
    row `row`; its sinks go to a slot of the new first page (allocated if it has none)."""
    n = int(torch.as_tensor(token_slots).numel())
    if n != copy.tokens:
        raise ValueError(f"the copy holds {copy.tokens} tokens, the request's slots {n}")
    pages = _pages(store, token_slots)
    if pages.numel() != (copy.k_pages[0].shape[0] if copy.k_pages else 0):
        raise ValueError("the copy's pages do not match the request's slots")
    row = _row(store, row)
    dev = pages.to(store.device)
    for buf, saved in zip(store.k_pages, copy.k_pages):
        buf[dev] = saved.to(buf.device)
    for buf, saved in zip(store.v_pages, copy.v_pages):
        buf[dev] = saved.to(buf.device)
    for name, ts in copy.tails.items():
        for t, saved in zip(store.tails[name], ts):
            t[row, : saved.shape[0]] = saved.to(t.device)
    if copy.sink_k is not None:
        slot = int(store.sink_slots_for(pages[:1], allocate=True)[0])
        for t, saved in zip(store.sink_k, copy.sink_k):
            t[slot] = saved.to(t.device)
        for t, saved in zip(store.sink_v, copy.sink_v):
            t[slot] = saved.to(t.device)
