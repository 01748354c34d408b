"""Decode attention on HACK pages with Triton: a plan/run wrapper (FlashInfer style)."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..attention import check_logit_cap, check_window
from ..layout import PageLayout
from .batch import PagedBatch, check_head_tables, plan_batch
from .decode_kernel import hack_decode_combine, hack_decode_kernel
from .launch import Launch
from .spec import CacheArgs, KernelSpec, cache_args, int8_mma_supported, kernel_spec, triton_next_pow2

MAX_SPLITS = 64


def decode_warps(spec: KernelSpec, dot_f16: bool) -> int:
    """Warps per decode program: 4, or 8 where 4 would spill registers (Π=128 pages, 4+
    head_dim groups, the FMA-based fp16 fallback), as measured by hack_ops.triton.aot."""
    return 8 if spec.page >= 128 or spec.ngroups >= 4 or dot_f16 else 4


def choose_splits(batch_size: int, kv_heads: int, max_pages: int, device: torch.device) -> int:
    """Flash-decoding split count: enough programs to fill the GPU about twice, never more
    splits than pages; a power of two so few variants get compiled."""
    if max_pages <= 1:
        return 1
    if device.type == "cuda":
        slots = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        slots = 4  # interpreter: exercise the split path without many programs
    want = max(1, -(-slots // max(1, batch_size * kv_heads)))
    return min(triton_next_pow2(want), triton_next_pow2(max_pages), MAX_SPLITS)


def window_pages(max_pages: int, page: int, window: int | None) -> int:
    """Pages a decode query can see: all of them, or those its window (window + 1 keys,
    anywhere on the page grid) touches."""
    return max_pages if window is None else min(max_pages, (window + page - 1) // page + 1)


def check_queries(name: str, q: Tensor, shape: tuple[int, ...]) -> None:
    if not q.is_floating_point() or tuple(q.shape) != shape or q.stride(-1) != 1:
        raise ValueError(f"{name} must be floating point {list(shape)}, contiguous along head_dim; got "
                         f"{q.dtype} {tuple(q.shape)}")


class HackDecodeAttention:
    """One query token per request over a paged HACK cache (plus FP16 tail and sinks).

    plan() takes the page table once per batch (all layers share it); run() is called per
    layer, with the layer's sliding window and soft-cap (hack_ops.attention's `window` and
    `logit_cap`; sm_scale is the layer's scaling). The new token must already be stored
    (hack_ops.triton.store, phase='all').
    dot_f16 forces the fp16-MMA integer product (default: only where INT8 MMA is missing).
    """

    def __init__(self, layout: PageLayout, num_qo_heads: int, sm_scale: float | None = None,
                 num_splits: int | None = None, dot_f16: bool | None = None) -> None:
        self.layout = layout
        self.spec = kernel_spec(layout)
        if num_qo_heads <= 0 or num_qo_heads % self.spec.heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a positive multiple of the "
                             f"KV heads ({self.spec.heads})")
        if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
        self.num_qo_heads = num_qo_heads
        self.sm_scale = 1.0 / math.sqrt(layout.head_dim) if sm_scale is None else float(sm_scale)
        self.fixed_splits = num_splits
        self.dot_f16 = dot_f16
        self.batch: PagedBatch | None = None
        self.head_tables = False
        self.num_splits = 1
        self.pages_per_split = 1

    def plan(self, kv_indptr: Tensor, kv_indices: Tensor, seq_lens: Tensor,
             tail_rows: Tensor | None = None, sink_slots: Tensor | None = None, head_tables: bool = False) -> None:
        """seq_lens count the new token. tail_rows: FP16 tail row per request (default: its
        index); sink_slots: sink row per request (default: the sequence's first page).
        head_tables: kv_indices holds one page list per KV head, as
        hack_ops.cuda.CudaDecodeAttention.plan takes it (sparse decode,
        hack_ops.paged.sparse.PageSelection.head_csr); sink_slots is then required."""
        if head_tables:
            check_head_tables(kv_indptr, kv_indices, sink_slots, self.spec.heads)
        b = plan_batch(kv_indptr, kv_indices, seq_lens, self.spec.page, None, tail_rows, sink_slots)
        self.batch = b
        self.head_tables = bool(head_tables)
        self._splits_by_span: dict[int, tuple[int, int]] = {}
        self.num_splits, self.pages_per_split = self.splits(None)

    def splits(self, window: int | None) -> tuple[int, int]:
        """(num_splits, pages_per_split) over the pages a query of this batch can see."""
        b = self.batch
        span = window_pages(b.max_pages, self.spec.page, window)
        if span not in self._splits_by_span:
            splits = self.fixed_splits or choose_splits(b.batch_size, self.spec.heads, span, b.kv_indices.device)
            n = max(1, min(splits, span))
            self._splits_by_span[span] = (n, max(1, -(-span // n)))
        return self._splits_by_span[span]

    def run(self, q: Tensor, k_buf: Tensor, v_buf: Tensor, tail_k: Tensor, tail_v: Tensor | None = None,
            sink_k: Tensor | None = None, sink_v: Tensor | None = None, out: Tensor | None = None,
            window: int | None = None, logit_cap: float = 0.0) -> Tensor:
        """q [B, Hq, D] -> out [B, Hq, D] (q's dtype unless `out` is given). Cache tensors as in
        hack_ops.triton.store.store (tail_v / sinks may be None when the format has none).
        window: keys t-window..t visible (None or -1: all); logit_cap > 0: tanh soft-capping."""
        if self.batch is None:
            raise RuntimeError("call plan() before run()")
        window, logit_cap = check_window(window), check_logit_cap(logit_cap)
        b = self.batch
        shape = (b.batch_size, self.num_qo_heads, self.spec.head_dim)
        check_queries("q", q, shape)
        cache = cache_args(self.layout, k_buf, v_buf, tail_k, tail_v, sink_k, sink_v)
        if out is None:
            out = torch.empty(shape, dtype=q.dtype, device=q.device)
        check_queries("out", out, shape)
        if b.batch_size == 0:
            return out
        num_splits, pages_per_split = self.splits(window)
        for launch in decode_launches(self.spec, b, q, cache, out, self.sm_scale, num_splits, pages_per_split,
                                      self._dot_f16(q.device), window, logit_cap, self.head_tables):
            launch()
        return out

    def _dot_f16(self, device: torch.device) -> bool:
        return (not int8_mma_supported(device)) if self.dot_f16 is None else self.dot_f16


def decode_launches(spec: KernelSpec, b: PagedBatch, q: Tensor, cache: CacheArgs, out: Tensor, sm_scale: float,
                    num_splits: int, pages_per_split: int, dot_f16: bool, window: int | None = None,
                    logit_cap: float = 0.0, head_tables: bool = False) -> list[Launch]:
    """The split kernel, plus the combine kernel when the sequence is split. window /
    logit_cap (checked values) switch the kernel's WINDOW / CAP variants on, head_tables its
    per-KV-head page lists."""
    hq = q.shape[1]
    rep = hq // spec.heads
    if num_splits == 1:
        o_arg = m_part = l_part = out
    else:
        o_arg = torch.empty(b.batch_size, hq, num_splits, spec.head_dim, dtype=torch.float32, device=q.device)
        m_part = torch.empty(b.batch_size, hq, num_splits, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
    launches = [Launch(
        hack_decode_kernel, (b.batch_size, spec.heads, num_splits),
        [q, q.stride(0), q.stride(1), *cache.args(),
         b.kv_indptr, b.kv_indices, b.seq_lens, b.tail_rows, b.sink_slots,
         o_arg, out.stride(0), out.stride(1), m_part, l_part, sm_scale, pages_per_split,
         0 if window is None else window, float(logit_cap)],
        dict(REP=rep, BLOCK_H=max(16, triton_next_pow2(rep)), P=spec.page, D=spec.head_dim, GD=spec.group,
             NG=spec.ngroups, K_BITS=spec.k_bits, V_BITS=spec.v_bits, S=spec.sinks, BS=spec.sink_block,
             V_TAIL=spec.v_tail, NSPLIT=num_splits, DOT_F16=dot_f16, WINDOW=window is not None, CAP=logit_cap > 0,
             HEAD_TABLES=head_tables),
        dict(num_warps=decode_warps(spec, dot_f16), num_stages=1),
    )]
    if num_splits > 1:
        launches.append(Launch(
            hack_decode_combine, (b.batch_size, hq),
            [o_arg, m_part, l_part, out, out.stride(0), out.stride(1)],
            dict(D=spec.head_dim, NSPLIT=num_splits, BLOCK_SPLIT=max(2, triton_next_pow2(num_splits))),
        ))
    return launches
