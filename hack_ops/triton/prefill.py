"""Prefill/extend attention on HACK pages with Triton: a plan/run wrapper (FlashInfer style).

run() does the whole extend step of one layer: the store's pages phase (new V codes, newly
closed K pages, sinks), the attention kernel, then the store's tail phase. The store is a
separate kernel, not fused into the attention: quantizing K per channel needs every token of a
page (possibly spanning several query blocks and the request's old FP16 tail), so a fused
version would redo that reduction in every query block and head of the GQA group, or need
cross-program synchronization; the store does it once per (page, head, channel group).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..attention import check_logit_cap, check_window
from ..layout import PageLayout
from .batch import PagedBatch, plan_batch
from .decode import check_queries
from .launch import Launch
from .prefill_kernel import hack_prefill_kernel
from .spec import CacheArgs, KernelSpec, cache_args, int8_mma_supported, kernel_spec
from .spec import triton_next_pow2
from .store import store_launch


PREFILL_BLOCK_M = 32  # query rows per program (16 where 32 would spill, see prefill_block_m)
PREFILL_WARPS = 8


def prefill_block_m(spec: KernelSpec, dot_f16: bool) -> int:
    """Query rows per program: 32, or 16 where 32 spills registers (4+ head_dim groups, the
    FMA-based fp16 fallback), as measured by hack_ops.triton.aot."""
    return 16 if spec.ngroups >= 4 or dot_f16 else PREFILL_BLOCK_M


class HackPrefillAttention:
    """Causal attention of each request's new tokens to its cached pages and to themselves."""

    def __init__(self, layout: PageLayout, num_qo_heads: int, sm_scale: float | None = None,
                 block_m: int | None = None, dot_f16: bool | None = None) -> None:
        self.layout = layout
        self.spec = kernel_spec(layout)
        if num_qo_heads <= 0 or num_qo_heads % self.spec.heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a positive multiple of the "
                             f"KV heads ({self.spec.heads})")
        if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
            raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
        self.num_qo_heads = num_qo_heads
        self.sm_scale = 1.0 / math.sqrt(layout.head_dim) if sm_scale is None else float(sm_scale)
        self.block_m = block_m
        self.dot_f16 = dot_f16
        self.batch: PagedBatch | None = None

    def plan(self, qo_indptr: Tensor, kv_indptr: Tensor, kv_indices: Tensor, seq_lens: Tensor,
             tail_rows: Tensor | None = None, sink_slots: Tensor | None = None) -> None:
        """qo_indptr: new-token offsets per request; seq_lens: prefix + new tokens; the page table
        covers all of them. tail_rows/sink_slots as in HackDecodeAttention.plan."""
        self.batch = plan_batch(kv_indptr, kv_indices, seq_lens, self.spec.page, qo_indptr, tail_rows, sink_slots)

    def run(self, q: Tensor, k: Tensor, v: Tensor, k_buf: Tensor, v_buf: Tensor, tail_k: Tensor,
            tail_v: Tensor | None = None, sink_k: Tensor | None = None, sink_v: Tensor | None = None,
            out: Tensor | None = None, save_kv_cache: bool = True, window: int | None = None,
            logit_cap: float = 0.0) -> Tensor:
        """q [N, Hq, D], k/v [N, H, D] (the new tokens, rows by qo_indptr) -> out [N, Hq, D].
        Cache tensors as in hack_ops.triton.store.store. save_kv_cache=False: the caller runs
        the store itself (pages phase before this call, tail phase after). window / logit_cap:
        the layer's sliding window (keys t-window..t; None or -1: all) and tanh soft-cap (> 0).
        The store writes every token whatever the window (the window only narrows the reads)."""
        if self.batch is None:
            raise RuntimeError("call plan() before run()")
        window, logit_cap = check_window(window), check_logit_cap(logit_cap)
        b, sp = self.batch, self.spec
        check_queries("q", q, (b.total_new, self.num_qo_heads, sp.head_dim))
        for name, t in (("k", k), ("v", v)):
            check_queries(name, t, (b.total_new, sp.heads, sp.head_dim))
        cache = cache_args(self.layout, k_buf, v_buf, tail_k, tail_v, sink_k, sink_v)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        check_queries("out", out, tuple(q.shape))
        if b.total_new == 0:
            return out
        if save_kv_cache:
            store_launch(sp, b, k, v, cache, "pages")()
        dot_f16 = self._dot_f16(q.device)
        prefill_launch(sp, b, q, k, v, cache, out, self.sm_scale, self._block_m(dot_f16), dot_f16, window, logit_cap)()
        if save_kv_cache:
            store_launch(sp, b, k, v, cache, "tail")()
        return out

    def _block_m(self, dot_f16: bool) -> int:
        if self.block_m:
            return self.block_m
        return min(prefill_block_m(self.spec, dot_f16), max(16, triton_next_pow2(self.batch.max_new)))

    def _dot_f16(self, device: torch.device) -> bool:
        return (not int8_mma_supported(device)) if self.dot_f16 is None else self.dot_f16


def prefill_launch(spec: KernelSpec, b: PagedBatch, q: Tensor, k: Tensor, v: Tensor, cache: CacheArgs,
                   out: Tensor, sm_scale: float, block_m: int, dot_f16: bool, window: int | None = None,
                   logit_cap: float = 0.0) -> Launch:
    """The attention kernel; window / logit_cap (checked values) switch its WINDOW / CAP variants on."""
    rep = q.shape[1] // spec.heads
    return Launch(
        hack_prefill_kernel, (-(-b.max_new // block_m), b.batch_size, q.shape[1]),
        [q, q.stride(0), q.stride(1), k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), *cache.args(),
         b.qo_indptr, b.prefix_lens, b.kv_indptr, b.kv_indices, b.tail_rows, b.sink_slots,
         out, out.stride(0), out.stride(1), sm_scale, 0 if window is None else window, float(logit_cap)],
        dict(REP=rep, BM=block_m, P=spec.page, D=spec.head_dim, GD=spec.group, NG=spec.ngroups,
             K_BITS=spec.k_bits, V_BITS=spec.v_bits, S=spec.sinks, BS=spec.sink_block, V_TAIL=spec.v_tail,
             DOT_F16=dot_f16, WINDOW=window is not None, CAP=logit_cap > 0),
        dict(num_warps=PREFILL_WARPS, num_stages=1),
    )
