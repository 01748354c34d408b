"""Run the CUDA decode and store kernels' own sources on the CPU (csrc/hack_simt_host.cpp): every thread a
fiber, the warp collectives (mma, movmatrix, shuffles) and barriers emulated, the same argument
struct that run() fills. For the CPU tests of the kernel's control flow, indexing and arithmetic;
slow (milliseconds per page), not a serving path.
"""
from __future__ import annotations

import ctypes

from torch import Tensor

from ..layout import PageLayout
from ..triton.batch import PagedBatch
from .build import Variant, simt_library
from .decode import CudaDecodeAttention
from .launch import DecodeParams, KernelLibraries
from .store import StoreParams
from .store import prepare as prepare_store


def _declare(lib: ctypes.CDLL) -> None:
    lib.hack_simt_decode.argtypes = [ctypes.POINTER(DecodeParams)]
    lib.hack_simt_decode.restype = ctypes.c_int
    lib.hack_simt_store.argtypes = [ctypes.POINTER(StoreParams)]
    lib.hack_simt_store.restype = ctypes.c_int


LIBS = KernelLibraries("the CUDA kernel's CPU harness", simt_library, _declare)


def load(variant: Variant) -> ctypes.CDLL:
    return LIBS.load(variant.name, variant)


def run_on_cpu(att: CudaDecodeAttention, q: Tensor, k_buf: Tensor, v_buf: Tensor, tail_k: Tensor,
               tail_v: Tensor | None = None, sink_k: Tensor | None = None, sink_v: Tensor | None = None,
               out: Tensor | None = None, window: int | None = None, logit_cap: float = 0.0) -> Tensor:
    """att.run(...) with CPU tensors, through the kernel's source compiled for the CPU."""
    if q.device.type != "cpu":
        raise ValueError(f"the CPU harness takes CPU tensors, got q on {q.device}")
    call = att.prepare(q, k_buf, v_buf, tail_k, tail_v, sink_k, sink_v, out, window, logit_cap)
    if call.params is not None:
        err = load(call.variant).hack_simt_decode(ctypes.byref(call.params))
        if err:
            raise RuntimeError({1: "a warp collective deadlocked (divergent lanes)", 2: "bad arguments"}.get(err, err))
    return call.out


def store_on_cpu(layout: PageLayout, batch: PagedBatch, k: Tensor, v: Tensor, k_buf: Tensor, v_buf: Tensor,
                 tail_k: Tensor, tail_v: Tensor | None = None, sink_k: Tensor | None = None,
                 sink_v: Tensor | None = None) -> None:
    """hack_ops.cuda.store.store_pages(...) with CPU tensors, through the kernel's source compiled
    for the CPU: the closing pages and the sinks (the tails are read, not written)."""
    if k.device.type != "cpu":
        raise ValueError(f"the CPU harness takes CPU tensors, got k on {k.device}")
    call = prepare_store(layout, batch, k, v, k_buf, v_buf, tail_k, tail_v, sink_k, sink_v)
    if call.params is not None:
        err = load(call.variant).hack_simt_store(ctypes.byref(call.params))
        if err:
            raise RuntimeError({1: "a block barrier deadlocked", 2: "bad arguments"}.get(err, err))
