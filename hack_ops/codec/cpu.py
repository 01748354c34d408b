"""The compiled CPU SplitZip codec (csrc/splitzip.c): build, load, call.

Plain C built with the machine's gcc into a cache directory keyed by source, flags and
compiler, loaded with ctypes (hack_ops.cbuild: the same build and load cache as the paged
attention kernel). Variants: 'native' (-O3 -march=native: the AVX-512 VBMI
path for BF16 where the CPU has it) and 'portable' (plain C loops). OpenMP splits the chunks
over `threads` (default 1: the codec shares cores with the server it runs in).
Environment: HACK_CODEC_CPU=0 disables it; HACK_KERNEL_CACHE sets the cache directory.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from ..cbuild import LibraryCache, build_library
from .codebook import Codebook
from .format import DEFAULT_CHUNK, CodecError, FloatFormat, check_chunk, max_stream_bytes

SOURCE = Path(__file__).parent / "csrc" / "splitzip.c"
VARIANTS = {
    "native": ["-O3", "-march=native", "-fopenmp"],
    "portable": ["-O3", "-fopenmp"],
}
ERRORS = {-1: "output buffer too small", -2: "bad arguments", -3: "bad stream header (format, length or chunk)",
          -4: "stream was coded with another codebook", -5: "stream truncated",
          -6: "escape stream out of range", -7: "bytes after the last chunk", -8: "out of memory"}

def build(variant: str = "native") -> Path:
    """Compile (if not cached) and return the library's path; RuntimeError on failure."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    return build_library(f"splitzip_{variant}", [SOURCE], [], VARIANTS[variant], "the SplitZip CPU codec")


def _declare(lib: ctypes.CDLL) -> None:
    i64, p, u32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint32
    lib.sz_encode.argtypes = [p, i64, ctypes.c_int, p, u32, i64, p, i64, ctypes.c_int]
    lib.sz_encode.restype = i64
    lib.sz_decode.argtypes = [p, i64, ctypes.c_int, p, u32, p, i64, ctypes.c_int]
    lib.sz_decode.restype = i64
    lib.sz_simd.restype = ctypes.c_int


def _disabled() -> str | None:
    return "disabled by HACK_CODEC_CPU=0" if os.environ.get("HACK_CODEC_CPU", "1") == "0" else None


_cache = LibraryCache(build, _declare, _disabled)
_errors = _cache.errors


def load(variant: str = "native") -> ctypes.CDLL | None:
    """The loaded library (built on first use), or None with the reason in why_not()."""
    return _cache.load(variant)


def why_not(variant: str = "native") -> str | None:
    return None if load(variant) is not None else _errors.get(variant, "not loaded")


def _lib(variant: str) -> ctypes.CDLL:
    lib = load(variant)
    if lib is None:
        raise RuntimeError(f"the SplitZip CPU codec is unavailable: {_errors.get(variant)}")
    return lib


def encode_ptr(src: int, n: int, book: Codebook, dst: int, cap: int, chunk: int = DEFAULT_CHUNK,
               threads: int = 1, variant: str = "native") -> int:
    """Code n 16-bit words at address `src` into `dst` (capacity `cap` bytes); returns the
    stream length. The caller keeps both buffers alive."""
    tab = bytes(book.exponents)
    r = _lib(variant).sz_encode(src, n, int(book.fmt), tab, book.ident, chunk, dst, cap, threads)
    if r < 0:
        raise ValueError(f"SplitZip encode failed: {ERRORS.get(r, r)}")
    return int(r)


def decode_ptr(src: int, length: int, book: Codebook, dst: int, n: int, threads: int = 1,
               variant: str = "native") -> None:
    """Decode a stream of `length` bytes at `src` into n words at `dst`; CodecError if damaged."""
    r = _lib(variant).sz_decode(src, length, int(book.fmt), bytes(book.exponents), book.ident, dst, n, threads)
    if r != 0:
        raise CodecError(f"SplitZip stream cannot be decoded: {ERRORS.get(int(r), r)}")


def encode(t: torch.Tensor, book: Codebook, chunk: int = DEFAULT_CHUNK, threads: int = 1,
           variant: str = "native") -> torch.Tensor:
    """The stream (uint8 tensor) of a CPU BF16/FP16 tensor."""
    if FloatFormat.of(t.dtype) is not book.fmt:
        raise ValueError(f"a {book.fmt.name} codebook cannot code a {t.dtype} tensor")
    check_chunk(chunk)
    t = t.contiguous()
    cap = max_stream_bytes(t.numel(), chunk)
    out = torch.empty(cap, dtype=torch.uint8)
    size = encode_ptr(t.data_ptr(), t.numel(), book, out.data_ptr(), cap, chunk, threads, variant)
    return out[:size]


def decode(stream: torch.Tensor, book: Codebook, n: int, threads: int = 1, variant: str = "native",
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The n values of a stream (1-D, the codebook's dtype), or into `out` (contiguous)."""
    stream = stream.contiguous()
    if out is None:
        out = torch.empty(n, dtype=book.fmt.torch_dtype)
    elif not out.is_contiguous() or out.numel() != n or out.dtype != book.fmt.torch_dtype:
        raise ValueError("out must be a contiguous tensor of n values of the codebook's dtype")
    decode_ptr(stream.data_ptr(), stream.numel(), book, out.data_ptr(), n, threads, variant)
    return out
