"""Decode attention on HACK pages with the CUDA kernel: the same plan/run interface as
hack_ops.triton.HackDecodeAttention (and the same checks of the page table and the cache), so a
server swaps one for the other per layer.

Numbers: the kernel computes on the codes in fp16 (Q' and P' rounded to fp16, no INT8), so its
outputs follow hack_ops.attention's 'dequant' mode to fp16 rounding (TOL_* below), and differ
from the 'hack' mode, which quantizes Q' and P' to INT8, by that mode's own INT8 error.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention import check_logit_cap, check_window
from ..layout import PageLayout
from ..triton.batch import PagedBatch, check_head_tables, plan_batch
from ..triton.spec import CacheArgs, cache_args
from .build import STAGES, Variant, device_arch
from .fragment import PAGE, CodeOrder
from .launch import DecodeParams, load
from .spec import layout_why_not, variant_for

WARPS = 4  # per block (csrc/hack_frag.cuh)
BLOCKS_PER_SM = 3  # resident blocks the registers allow (~165 per thread at head_dim 128)
MIN_SPLIT_PAGES = 2 * WARPS  # a split gives each warp at least two pages to pipeline
MAX_SPLITS = 256

# Tolerances against hack_ops.attention(mode='dequant') on the same pages, fp16 outputs (the GPU
# tests). hack_ops.cuda.emulate replays the kernel's fp16 roundings (Q' = Q ⊙ s_K, P and P' = P ⊙
# s_V, 2^-11 relative each) on the CPU: max 3.4e-4, mean 7e-5 from 'dequant' on randn data
# (tests/test_cuda_emulate.py, EMULATION_*); the GPU adds the output's fp16 rounding (<= 4.9e-4
# for |o| < 1), ex2.approx and fp32 sums in another order. bf16 outputs round at 2^-9 relative.
TOL_MAX_ABS = 2e-3
TOL_MEAN_ABS = 2.5e-4
TOL_BF16_MAX_ABS = 1.5e-2


def _fingerprint(t: Tensor | None) -> tuple | None:
    return None if t is None else (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)


def choose_splits(batch: int, kv_heads: int, span_pages: int, sms: int) -> int:
    """Splits of the sequence: as many as fit one wave of resident blocks (BLOCKS_PER_SM x SMs),
    at most ~sqrt(pages) (the combine pass reads every split, a cost that grows with their
    count while a block's pages shrink with it), never fewer than MIN_SPLIT_PAGES pages each.

    From a sweep of 1-64 splits on an H100 (docs/kernels.md, "Split count"): a second wave of
    blocks costs more than longer splits in one (batch 8 x 32K, Llama-3-8B heads: 7 splits =
    448 blocks took 0.114 ms, 6 = 384 blocks 0.088 ms), and a grid that fills the GPU already is
    fastest unsplit (batch 32 x 8K: 1 split 0.084 ms, 3 splits 0.096 ms)."""
    most = min(span_pages // MIN_SPLIT_PAGES, MAX_SPLITS)
    pairs, slots = max(1, batch * kv_heads), BLOCKS_PER_SM * sms
    return max(1, min(slots // pairs, math.isqrt(span_pages), most))


@dataclass
class Call:
    """A checked run: the library variant, its argument struct (None: nothing to compute), the
    output, and the tensors the struct points into that nothing else holds."""

    variant: Variant
    params: DecodeParams | None
    out: Tensor
    keep: tuple


class CudaDecodeAttention:
    """One query token per request over a paged HACK cache (FP16 tail and sinks included).

    plan() takes the page table once per batch; run() is called per layer with the layer's
    sliding window and soft-cap. The new token must already be stored (the Triton store).
    order: the code order of the pages (CodeOrder.TOKEN: the pool's; FRAGMENT: converted by
    hack_ops.cuda.fragment.convert_pages). stages: pages in flight per warp (2 serves; 3 is timed
    beside it by hack_cli.bench_decode_cuda).
    """

    def __init__(self, layout: PageLayout, num_qo_heads: int, sm_scale: float | None = None,
                 num_splits: int | None = None, order: CodeOrder = CodeOrder.TOKEN, stages: int = 2) -> None:
        why = layout_why_not(layout, num_qo_heads)
        if why is not None:
            raise NotImplementedError(f"the CUDA decode kernel does not read this layer: {why}")
        if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
        self.layout = layout
        self.num_qo_heads = num_qo_heads
        self.rep = num_qo_heads // layout.num_heads
        self.sm_scale = 1.0 / math.sqrt(layout.head_dim) if sm_scale is None else float(sm_scale)
        self.fixed_splits = num_splits
        self.order = CodeOrder(order)
        if stages not in STAGES:
            raise ValueError(f"stages must be one of {STAGES}, got {stages}")
        self.stages = stages
        self.batch: PagedBatch | None = None
        self.head_tables = False
        self._splits: dict[int, tuple[int, int]] = {}
        self._last: tuple | None = None  # (arguments' fingerprint, Call, library) of the last run

    def plan(self, kv_indptr: Tensor, kv_indices: Tensor, seq_lens: Tensor,
             tail_rows: Tensor | None = None, sink_slots: Tensor | None = None, head_tables: bool = False) -> None:
        """seq_lens count the new token. tail_rows: FP16 tail row per request (default: its
        index); sink_slots: sink row per request (default: the sequence's first page).
        head_tables: kv_indices holds one page list per KV head (sparse decode: each head reads
        its own selected pages, as many per head of a request): request b's n_b = kv_indptr[b+1]
        - kv_indptr[b] pages of head h are kv_indices[kv_indptr[b] * H + h * n_b:][:n_b]
        (hack_ops.paged.sparse.PageSelection.head_csr); sink_slots is then required."""
        if head_tables:
            check_head_tables(kv_indptr, kv_indices, sink_slots, self.layout.num_heads)
        self.batch = plan_batch(kv_indptr, kv_indices, seq_lens, PAGE, None, tail_rows, sink_slots)
        self.head_tables = bool(head_tables)
        self._splits = {}
        self._last = None

    def splits(self, window: int | None) -> tuple[int, int]:
        """(num_splits, pages_per_split) over the pages a query of this batch can see."""
        b = self.batch
        span = b.max_pages if window is None else min(b.max_pages, (window + PAGE - 1) // PAGE + 1)
        if span not in self._splits:
            dev = b.kv_indices.device
            sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
            n = self.fixed_splits or choose_splits(b.batch_size, self.layout.num_heads, span, sms)
            pps = max(1, -(-span // max(1, min(n, span))))
            self._splits[span] = (max(1, -(-span // pps)), pps)
        return self._splits[span]

    def run(self, q: Tensor, k_buf: Tensor, v_buf: Tensor, tail_k: Tensor, tail_v: Tensor | None = None,
            sink_k: Tensor | None = None, sink_v: Tensor | None = None, out: Tensor | None = None,
            window: int | None = None, logit_cap: float = 0.0) -> Tensor:
        """q [B, Hq, D] bf16 or fp16 -> out [B, Hq, D] in q's dtype. Cache tensors as in
        hack_ops.triton.store.store. window: keys t-window..t visible (None or -1: all);
        logit_cap > 0: tanh soft-capping."""
        if q.device.type != "cuda":
            raise ValueError(f"the CUDA decode kernel runs on CUDA tensors, got q on {q.device}")
        # A call repeating the last one's tensors (same memory, shapes, strides: a benchmark, a
        # CUDA-graph warm-up) reuses its checked arguments: the launch then costs ~10 µs of Python.
        key = None
        if out is not None:
            key = (self.sm_scale, window, logit_cap, *(_fingerprint(t) for t in (q, k_buf, v_buf, tail_k, tail_v, sink_k,
                                                                                  sink_v, out)))
        if key is not None and self._last is not None and self._last[0] == key:
            call, lib = self._last[1], self._last[2]
        else:
            call = self.prepare(q, k_buf, v_buf, tail_k, tail_v, sink_k, sink_v, out, window, logit_cap)
            if call.params is None:
                return call.out
            lib = load(call.variant, device_arch(q.device))
            self._last = (key, call, lib) if key is not None else None
        stream = torch.cuda.current_stream(q.device).cuda_stream
        err = lib.hack_cuda_decode(ctypes.byref(call.params), q.device.index or 0, ctypes.c_void_p(stream))
        if err:
            raise RuntimeError(f"the CUDA decode kernel failed to launch: {lib.hack_cuda_error_string(err).decode()}")
        return call.out

    def prepare(self, q: Tensor, k_buf: Tensor, v_buf: Tensor, tail_k: Tensor, tail_v: Tensor | None,
                sink_k: Tensor | None, sink_v: Tensor | None, out: Tensor | None, window: int | None,
                logit_cap: float) -> "Call":
        """Check a run's arguments (all on q's device) and fill the kernel's argument struct; the
        launch is run()'s (or the CPU harness's, hack_ops.cuda.simt)."""
        if self.batch is None:
            raise RuntimeError("call plan() before run()")
        window, logit_cap = check_window(window), check_logit_cap(logit_cap)
        b = self.batch
        shape = (b.batch_size, self.num_qo_heads, self.layout.head_dim)
        variant = variant_for(self.layout, q.dtype, logit_cap, self.order, self.stages)  # bf16 / fp16, or ValueError
        if tuple(q.shape) != shape:
            raise ValueError(f"q must be {list(shape)}, got {tuple(q.shape)}")
        if q.stride(-1) != 1 or q.stride(0) % 8 or q.stride(1) % 8 or q.data_ptr() % 16:
            q = q.contiguous()  # the kernel reads 16-byte vectors of q
        cache = cache_args(self.layout, k_buf, v_buf, tail_k, tail_v, sink_k, sink_v)
        for name, t in (("k_buf", k_buf), ("v_buf", v_buf), ("tail_k", cache.tail_k), ("tail_v", cache.tail_v),
                        ("sink_k", cache.sink_k), ("sink_v", cache.sink_v)):
            if t.device != q.device or t.data_ptr() % 16:
                raise ValueError(f"{name} must be on {q.device} and 16-byte aligned (the kernel copies 16-byte chunks)")
        if b.kv_indices.device != q.device:
            raise ValueError(f"plan() took the page table on {b.kv_indices.device}, q is on {q.device}")
        if out is None:
            out = torch.empty(shape, dtype=q.dtype, device=q.device)
        if out.dtype != q.dtype or tuple(out.shape) != shape or out.stride(-1) != 1 or out.device != q.device:
            raise ValueError(f"out must be {q.dtype} {list(shape)} on {q.device}, contiguous along head_dim; got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        if b.batch_size == 0:
            return Call(variant, None, out, ())
        n, pps = self.splits(window)
        parts: tuple[Tensor, ...] = ()
        if n > 1:
            o_part = torch.empty(b.batch_size, self.num_qo_heads, n, shape[2], dtype=torch.float32, device=q.device)
            ml = torch.empty(2, b.batch_size, self.num_qo_heads, n, dtype=torch.float32, device=q.device)
            parts = (o_part, ml[0], ml[1])
        p = self._params(q, k_buf, v_buf, cache, out, parts or None, n, pps, window, logit_cap)
        return Call(variant, p, out, (q, *parts))

    def _params(self, q: Tensor, k_buf: Tensor, v_buf: Tensor, cache: CacheArgs, out: Tensor,
                parts: tuple[Tensor, Tensor, Tensor] | None, n: int, pps: int, window: int | None,
                logit_cap: float) -> DecodeParams:
        lay, b = self.layout, self.batch
        p = DecodeParams()
        p.q, p.q_sb, p.q_sh = q.data_ptr(), q.stride(0), q.stride(1)
        p.k_buf, p.v_buf = k_buf.data_ptr(), v_buf.data_ptr()
        p.k_page, p.v_page = k_buf.stride(0), v_buf.stride(0)
        p.kc_off, p.km_off, p.ks_off = lay.k.codes.offset, lay.k.minimum.offset, lay.k.scale.offset
        p.vc_off, p.vm_off, p.vs_off = lay.v.codes.offset, lay.v.minimum.offset, lay.v.scale.offset
        t, s = cache.tail_k, cache.sink_k
        p.tail_k, p.tail_v = t.data_ptr(), cache.tail_v.data_ptr()
        p.t_row, p.t_tok, p.t_head = t.stride(0), t.stride(1), t.stride(2)
        p.sink_k, p.sink_v = s.data_ptr(), cache.sink_v.data_ptr()
        p.s_slot, p.s_tok, p.s_head = s.stride(0), s.stride(1), s.stride(2)
        p.kv_indptr, p.kv_indices, p.seq_lens = b.kv_indptr.data_ptr(), b.kv_indices.data_ptr(), b.seq_lens.data_ptr()
        p.tail_rows, p.sink_slots = b.tail_rows.data_ptr(), b.sink_slots.data_ptr()
        p.out, p.o_sb, p.o_sh = out.data_ptr(), out.stride(0), out.stride(1)
        if parts is not None:
            p.o_part, p.m_part, p.l_part = (x.data_ptr() for x in parts)
        p.sm_scale, p.logit_cap = self.sm_scale, logit_cap
        p.window = -1 if window is None else window
        p.rep, p.sinks = self.rep, lay.config.sink_tokens
        p.pages_per_split, p.num_splits = pps, n
        p.batch, p.kv_heads = b.batch_size, lay.num_heads
        p.head_tables = int(self.head_tables)
        return p
