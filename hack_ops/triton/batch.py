"""Batch metadata the Triton kernels read: a page table per request (CSR, FlashInfer style),
sequence lengths, new-token offsets, and the rows of the per-request FP16 tail and sinks.

`plan_batch` validates everything once on the host and keeps the few host-side integers the
launches need (grid sizes), so `run` never synchronizes with the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PagedBatch:
    kv_indptr: Tensor  # int32 [B+1]: request b's pages are kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices: Tensor  # int32: page ids, in sequence order (any order in the pool)
    seq_lens: Tensor  # int32 [B]: tokens in the cache once this step's tokens are stored
    qo_indptr: Tensor  # int32 [B+1]: new tokens of request b are rows qo_indptr[b]:qo_indptr[b+1]
    prefix_lens: Tensor  # int32 [B]: seq_lens - new tokens (already stored before this step)
    tail_rows: Tensor  # int32 [B]: row of the request in the FP16 tail buffer
    sink_slots: Tensor  # int32 [B]: row of the request's sinks in the sink buffers
    max_new: int  # max new tokens of a request
    max_pages: int  # max pages of a request
    max_touched: int  # max pages a request's new tokens touch
    total_new: int  # new tokens in the whole batch

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]


def _int32(name: str, t, device) -> Tensor:
    t = torch.as_tensor(t)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.int32).contiguous()


def plan_batch(
    kv_indptr: Tensor,
    kv_indices: Tensor,
    seq_lens: Tensor,
    page_size: int,
    qo_indptr: Tensor | None = None,
    tail_rows: Tensor | None = None,
    sink_slots: Tensor | None = None,
) -> PagedBatch:
    """Check a batch and return its PagedBatch.

    qo_indptr=None means one new token per request (decode). tail_rows defaults to the request
    index; sink_slots defaults to the first page of each sequence (sinks keyed by first page).
    """
    dev = kv_indices.device
    indptr = _int32("kv_indptr", kv_indptr, dev)
    indices = _int32("kv_indices", kv_indices, dev)
    lens = _int32("seq_lens", seq_lens, dev)
    b = lens.shape[0]
    if indptr.shape[0] != b + 1:
        raise ValueError(f"kv_indptr must have batch+1 = {b + 1} entries, got {indptr.shape[0]}")
    qo = torch.arange(b + 1, dtype=torch.int32, device=dev) if qo_indptr is None else _int32("qo_indptr", qo_indptr, dev)
    if qo.shape[0] != b + 1:
        raise ValueError(f"qo_indptr must have batch+1 = {b + 1} entries, got {qo.shape[0]}")
    h_indptr, h_lens, h_qo = indptr.cpu().long(), lens.cpu().long(), qo.cpu().long()
    n_pages = h_indptr[1:] - h_indptr[:-1]
    new = h_qo[1:] - h_qo[:-1]
    if b and (h_indptr[0] != 0 or h_qo[0] != 0 or (n_pages < 0).any() or (new < 0).any()):
        raise ValueError("kv_indptr and qo_indptr must start at 0 and be non-decreasing")
    if int(h_indptr[-1]) > indices.shape[0]:
        raise ValueError(f"kv_indptr ends at {int(h_indptr[-1])} but kv_indices has {indices.shape[0]} entries")
    if (h_lens < 1).any() or (new > h_lens).any():
        raise ValueError("every request needs seq_len >= 1 and at most seq_len new tokens")
    need = (h_lens + page_size - 1) // page_size
    if (n_pages < need).any():
        bad = int(torch.nonzero(n_pages < need)[0])
        raise ValueError(f"request {bad} has {int(n_pages[bad])} pages for {int(h_lens[bad])} tokens "
                         f"(page size {page_size})")
    prefix = h_lens - new
    touched = torch.where(new > 0, (h_lens - 1) // page_size - prefix // page_size + 1, 0)
    rows = torch.arange(b, dtype=torch.int32, device=dev) if tail_rows is None else _int32("tail_rows", tail_rows, dev)
    sinks = indices[indptr[:-1].long()] if sink_slots is None else _int32("sink_slots", sink_slots, dev)
    if rows.shape[0] != b or sinks.shape[0] != b:
        raise ValueError(f"tail_rows and sink_slots need {b} entries")
    return PagedBatch(indptr, indices, lens, qo, prefix.to(device=dev, dtype=torch.int32), rows,
                      sinks.contiguous(), int(new.max()) if b else 0, int(n_pages.max()) if b else 0,
                      int(touched.max()) if b else 0, int(h_qo[-1]))


def check_head_tables(kv_indptr: Tensor, kv_indices: Tensor, sink_slots: Tensor | None, kv_heads: int) -> None:
    """A per-KV-head page table's own checks (sparse decode, the decode kernels' head_tables):
    request b's n_b = kv_indptr[b+1] - kv_indptr[b] pages of head h are kv_indices[kv_indptr[b] *
    H + h * n_b:][:n_b] (hack_ops.paged.sparse.PageSelection.head_csr); the sinks' rows must be
    given, since the first page of a head's list is a selection, not the sequence's own."""
    if sink_slots is None:
        raise ValueError("head_tables: pass sink_slots (the first page of each head's list is a selection)")
    need = int(kv_indptr[-1]) * kv_heads
    if kv_indices.numel() < need:
        raise ValueError(f"head_tables: kv_indices has {kv_indices.numel()} entries, {kv_heads} "
                         f"KV heads x {int(kv_indptr[-1])} pages need {need}")


def batch_from_plan(plan, device: torch.device | str | None = None) -> PagedBatch:
    """A PagedBatch from hack_ops.paged's ForwardPlan (its padded page table, request rows and
    sink slots), so the Triton kernels and the CPU path run on one plan."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    indptr, indices = plan.csr_pages(dev)
    return plan_batch(indptr, indices, plan.seq_lens.to(dev), plan.page_size,
                      qo_indptr=plan.qo_indptr.to(dev), tail_rows=plan.rows.to(dev),
                      sink_slots=plan.sink_slot.to(dev))
