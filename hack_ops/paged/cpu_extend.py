"""The tiled extend (prefill) kernel, csrc/hack_extend.c: which path an extend takes, and the call.

Paths, best first (ExtendPath): 'vnni' (the tiled kernel built with AVX-512 VNNI), 'portable'
(the same kernel in plain C: the build without SIMD intrinsics, chosen when the compiler or CPU
lacks AVX-512 VNNI), 'per-query' (the decode kernel run once per new token, the previous
extend; kept as a fallback), 'torch' (portable PyTorch). HACK_EXTEND_KERNEL=per-query or
=portable forces those paths (tests, comparisons); HACK_CPU_KERNEL=0 turns all compiled code
off. AMX-INT8 tiles are not built: the kernel was written on a CPU without AMX, and on one with
AMX its time goes to the per-page work around the dot products, not to the dots (docs/engine.md,
"On an AVX-512 + AMX host"), so tiles come after that work is amortized. amx_note() says which
case the running CPU is.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from enum import Enum
from pathlib import Path

import torch

from ..modes import AttentionMode, PrefillMode
from . import cpu_kernel
from .chunk_codes import LEVELS, ChunkCodes, window_pages

logger = logging.getLogger(__name__)


def cpu_has_amx_int8(cpuinfo: str | None = None) -> bool:
    """Whether the CPU's flags (/proc/cpuinfo, or the given text) include amx_int8."""
    if cpuinfo is None:
        return _this_cpu_has_amx_int8()
    return any(line.startswith("flags") and "amx_int8" in line.split() for line in cpuinfo.splitlines())


@functools.cache
def _this_cpu_has_amx_int8() -> bool:  # read once: choose() runs on every layer's extend
    try:
        return cpu_has_amx_int8(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False


def amx_note(cpuinfo: str | None = None) -> str:
    """The clause the path descriptions end with: AMX-INT8 is not used, and whether this CPU has it."""
    if cpu_has_amx_int8(cpuinfo):
        return "AMX-INT8 not used (this CPU has it; the kernel does not use it yet)"
    return "AMX-INT8 not used (this CPU has none)"


_I64 = ctypes.c_int64
_P = ctypes.c_void_p


class ExtendPath(str, Enum):
    VNNI = "vnni"  # the tiled kernel, INT8 dot products with AVX-512 VNNI
    AVX2 = "avx2"  # the tiled kernel, INT8 dot products with AVX2 (vpmaddubsw + vpmaddwd)
    PORTABLE = "portable"  # the tiled kernel in plain C
    PER_QUERY = "per-query"
    TORCH = "torch"


TILED = (ExtendPath.VNNI, ExtendPath.AVX2, ExtendPath.PORTABLE)  # the tiled kernel's builds


class _XArgs(ctypes.Structure):
    _fields_ = [(n, _I64) for n in (
        *cpu_kernel.GEOMETRY_FIELDS, "v_open_quantized", "exact", "meta_fp32", "max_pages",
        *cpu_kernel.PAGE_FIELDS, "block_tokens", "window")] + [
        ("logit_cap", ctypes.c_double)] + [
        (n, _P) for n in ("prefix_lens", "seq_lens", "q_start", "page_table", "sink_slots", "win_off",
                          "k_pages", "v_pages", "k_win", "v_win", "sink_k", "sink_v", "q", "out",
                          "chunk_page0", "ck_codes", "cv_codes", "ck_scale", "ck_min", "ck_sums", "cv_scale",
                          "cv_min")]


class _CArgs(ctypes.Structure):
    _fields_ = [(n, _I64) for n in ("batch", "heads", "head_dim", "page_size", "group", "sink_tokens", "levels",
                                     "nthreads")] + [
        (n, _P) for n in ("win_start", "seq_lens", "win_off", "page0", "k_win", "v_win", "k_codes", "v_codes",
                          "k_scale", "k_min", "k_sums", "v_scale", "v_min")]


def _lib(variant: str) -> ctypes.CDLL | None:
    lib = cpu_kernel.load(variant)
    if lib is None or not hasattr(lib, "hack_extend") or not hasattr(lib, "hack_chunk_codes"):
        return None
    lib.hack_extend.argtypes = [ctypes.POINTER(_XArgs)]
    lib.hack_extend.restype = ctypes.c_int
    lib.hack_chunk_codes.argtypes = [ctypes.POINTER(_CArgs)]
    lib.hack_chunk_codes.restype = ctypes.c_int
    lib.hack_extend_isa.restype = ctypes.c_int
    return lib


def build_variant() -> str:
    """The build the tiled kernel runs from: 'native' (-march=native) unless
    HACK_EXTEND_KERNEL=portable asks for the plain-C build."""
    return "portable" if os.environ.get("HACK_EXTEND_KERNEL") == "portable" else "native"


def why_not(store, mode: AttentionMode | str, generator=None, variant: str = "native",
            prefill: PrefillMode | str = PrefillMode.HOMOMORPHIC) -> str | None:
    """Why the tiled kernel cannot run this extend (None: it can)."""
    if os.environ.get("HACK_EXTEND_KERNEL", "tiled") == "per-query":
        return "HACK_EXTEND_KERNEL=per-query selects the per-query kernel"
    reason = cpu_kernel.why_not(store, mode, generator, variant, phase="extend", prefill=prefill)
    if reason is not None:
        return reason
    if _lib(variant) is None:
        return "the built kernel library has no hack_extend (stale build)"
    return None


def choose(store, mode: AttentionMode | str, generator=None, backend: str = "auto", window: int | None = None,
           logit_cap: float = 0.0, prefill: PrefillMode | str = PrefillMode.HOMOMORPHIC) -> tuple[ExtendPath, str]:
    """The path an extend with this store, AttentionMode and PrefillMode (and the layer's
    sliding window / soft-cap, which every compiled path has) takes, and a sentence saying why."""
    if backend not in ("auto", "torch", "cpu"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'cpu', got {backend!r}")
    if backend == "torch":
        return ExtendPath.TORCH, "backend='torch' asked for"
    tiled = why_not(store, mode, generator, build_variant(), prefill)
    if tiled is None:
        path = tiled_path(build_variant())
        if path == ExtendPath.VNNI:
            return path, f"tiled INT8 kernel with AVX-512 VNNI; {amx_note()}"
        if path == ExtendPath.AVX2:
            return path, f"tiled INT8 kernel with AVX2 (no AVX-512 VNNI on this CPU); {amx_note()}"
        return path, f"tiled kernel in plain C (no AVX2 or AVX-512 VNNI in this build); {amx_note()}"
    if PrefillMode(prefill) == PrefillMode.INT8:  # the per-query kernel has no chunk codes
        return ExtendPath.TORCH, f"PyTorch, because the tiled kernel does not apply: {tiled}"
    per_query = cpu_kernel.why_not(store, mode, generator, phase="extend", window=window, logit_cap=logit_cap,
                                   prefill=prefill)
    if per_query is None:
        return ExtendPath.PER_QUERY, f"per-query decode kernel, because the tiled kernel does not apply: {tiled}"
    return ExtendPath.TORCH, f"PyTorch, because the compiled kernels do not apply: {per_query}"


def describe(store, mode: AttentionMode | str, generator=None,
             prefill: PrefillMode | str = PrefillMode.HOMOMORPHIC) -> str:
    """One line for the server log and the benchmark: path name and reason."""
    path, why = choose(store, mode, generator, prefill=prefill)
    return f"{path.value} ({why})"


def simd(variant: str = "native") -> bool:
    """Whether the build has the AVX-512 VNNI path."""
    return tiled_path(variant) == ExtendPath.VNNI


def tiled_path(variant: str = "native") -> ExtendPath:
    """Which instructions the tiled kernel's INT8 dot products use in this build (PORTABLE when
    the library cannot be loaded: why_not says why)."""
    lib = _lib(variant)
    isa = lib.hack_extend_isa() if lib is not None else 0
    return {2: ExtendPath.VNNI, 1: ExtendPath.AVX2}.get(isa, ExtendPath.PORTABLE)


def _i64(x) -> torch.Tensor:
    return torch.as_tensor(x).to(torch.int64).contiguous()


def attend(store, layer: int, plan, q: torch.Tensor, scale: float, k_win: torch.Tensor, v_win: torch.Tensor,
           win_off, exact: bool, variant: str | None = None, block_tokens: int = 0, window: int | None = None,
           logit_cap: float = 0.0, chunk: ChunkCodes | None = None) -> torch.Tensor:
    """Extend attention of the plan's new tokens q [N, Hq, D] (stored already; exact: the
    PrefillMode is 'exact', the new tokens read in FP16 from the windows): request b's
    FP16 window starts at position (prefix // Π) * Π, element offset win_off[b] of k_win/v_win
    (fp16 [.., H, D]). window (keys t-window..t; None: all; pages before the first query's
    window are not read) and logit_cap (0: none) are the layer's. Returns float32 [N, Hq, D].
    block_tokens > 0 sets the query positions per work item (results do not depend on it, nor
    on the thread count). chunk: PrefillMode.INT8's codes of the windows (chunk_codes), read
    instead of the pool's pages from each request's window on."""
    variant = variant or build_variant()
    lib = _lib(variant)
    if lib is None:
        raise RuntimeError(cpu_kernel._errors.get(variant, "the CPU kernel is not available"))
    n, hq, d = q.shape
    shared = cpu_kernel.shared_args(store, layer, q, plan.page_table.shape[1])
    cpu_kernel.check_contiguous(store.k_pages[layer], store.v_pages[layer], k_win, v_win, store.sink_k[layer],
                                store.sink_v[layer])
    if k_win.dtype != torch.float16 or v_win.dtype != torch.float16:
        raise RuntimeError("the FP16 windows must be float16")
    qs = (q.float() * scale).contiguous()
    out = torch.empty(n, hq, d, dtype=torch.float32)
    keep = [_i64(x) for x in (plan.prefix_lens, plan.seq_lens, plan.qo_indptr, plan.page_table,
                              plan.sink_slot.clamp(min=0), win_off)]
    pre, seq, qo, table, sinks, woff = keep
    a = _XArgs(
        batch=plan.batch_size, **shared, exact=int(exact), block_tokens=block_tokens,
        window=-1 if window is None else int(window), logit_cap=float(logit_cap or 0.0),
        prefix_lens=pre.data_ptr(), seq_lens=seq.data_ptr(), q_start=qo.data_ptr(), page_table=table.data_ptr(),
        sink_slots=sinks.data_ptr(), win_off=woff.data_ptr(),
        k_pages=store.k_pages[layer].data_ptr(), v_pages=store.v_pages[layer].data_ptr(),
        k_win=k_win.data_ptr(), v_win=v_win.data_ptr(), sink_k=store.sink_k[layer].data_ptr(),
        sink_v=store.sink_v[layer].data_ptr(), q=qs.data_ptr(), out=out.data_ptr(),
    )
    if chunk is not None:
        if exact:
            raise ValueError("the chunk's own codes are PrefillMode.INT8's; 'exact' reads the chunk in FP16")
        parts = (chunk.page0, chunk.k_codes, chunk.v_codes, chunk.k_scale, chunk.k_min, chunk.k_sums,
                 chunk.v_scale, chunk.v_min)
        cpu_kernel.check_contiguous(*parts)
        for name, x in zip(("chunk_page0", "ck_codes", "cv_codes", "ck_scale", "ck_min", "ck_sums", "cv_scale",
                            "cv_min"), parts):
            setattr(a, name, x.data_ptr())
    _raise_for(lib.hack_extend(ctypes.byref(a)), "the tiled extend kernel")
    return out


def chunk_codes(k_win: torch.Tensor, v_win: torch.Tensor, win_off: torch.Tensor, prefix_lens: list[int],
                seq_lens: list[int], page_size: int, group: int, sink_tokens: int,
                variant: str | None = None) -> ChunkCodes:
    """hack_ops.paged.chunk_codes.quantize_chunks (the reference, same arguments) compiled: the
    same codes and side tables, made in C beside the kernel that reads them."""
    lib = _lib(variant or build_variant())
    if lib is None:
        raise RuntimeError(cpu_kernel._errors.get(variant or build_variant(), "the CPU kernel is not available"))
    cpu_kernel.check_contiguous(k_win, v_win)
    if k_win.dtype != torch.float16 or v_win.dtype != torch.float16:
        raise RuntimeError("the FP16 windows must be float16")
    p = page_size
    h, d = k_win.shape[1], k_win.shape[2]
    starts, counts, page0 = window_pages(prefix_lens, seq_lens, p)
    n, ng = sum(counts), d // group
    cc = ChunkCodes(page0=_i64(page0), count=_i64(counts),
                    k_codes=torch.empty(n, h, p, d, dtype=torch.uint8), k_scale=torch.empty(n, h, d),
                    k_min=torch.empty(n, h, d), k_sums=torch.empty(n, h, p, ng),
                    v_codes=torch.empty(n, h, p, d, dtype=torch.uint8), v_scale=torch.empty(n, h, p, ng),
                    v_min=torch.empty(n, h, p, ng))
    keep = [_i64(x) for x in (starts, seq_lens, win_off)]
    a = _CArgs(batch=len(seq_lens), heads=h, head_dim=d, page_size=p, group=group, sink_tokens=sink_tokens,
               levels=LEVELS, nthreads=torch.get_num_threads(),
               win_start=keep[0].data_ptr(), seq_lens=keep[1].data_ptr(), win_off=keep[2].data_ptr(),
               page0=cc.page0.data_ptr(), k_win=k_win.data_ptr(), v_win=v_win.data_ptr(),
               **{name: getattr(cc, name).data_ptr() for name in ("k_codes", "v_codes", "k_scale", "k_min", "k_sums",
                                                                  "v_scale", "v_min")})
    _raise_for(lib.hack_chunk_codes(ctypes.byref(a)), "the chunk-code kernel")
    return cc


def _raise_for(rc: int, kernel: str) -> None:
    """The error a return code of hack_extend.c's entry points stands for (0: none)."""
    if rc == -1:
        raise RuntimeError(f"{kernel} rejected the geometry")
    if rc != 0:
        raise MemoryError(f"{kernel} could not allocate its scratch memory")
