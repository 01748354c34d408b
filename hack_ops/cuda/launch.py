"""The decode kernel's argument struct on the Python side, and its libraries, loaded once each.

`DecodeParams` mirrors csrc/hack_params.h field for field (tests/test_cuda_host_model.py checks
every offset against offsetof); `load(variant, arch)` builds (hack_ops.cuda.build) and loads the
library of one variant, through hack_ops.cbuild.LibraryCache: a failed build is reported once per
process and not retried.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Callable

from ..cbuild import LibraryCache
from .build import Variant, library

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float

FIELDS = (
    ("q", _P), ("q_sb", _I64), ("q_sh", _I64), ("k_buf", _P), ("v_buf", _P), ("k_page", _I64), ("v_page", _I64),
    ("kc_off", _I64), ("km_off", _I64), ("ks_off", _I64), ("vc_off", _I64), ("vm_off", _I64), ("vs_off", _I64),
    ("tail_k", _P), ("tail_v", _P), ("t_row", _I64), ("t_tok", _I64), ("t_head", _I64),
    ("sink_k", _P), ("sink_v", _P), ("s_slot", _I64), ("s_tok", _I64), ("s_head", _I64),
    ("kv_indptr", _P), ("kv_indices", _P), ("seq_lens", _P), ("tail_rows", _P), ("sink_slots", _P),
    ("out", _P), ("o_sb", _I64), ("o_sh", _I64), ("o_part", _P), ("m_part", _P), ("l_part", _P),
    ("sm_scale", _F32), ("logit_cap", _F32), ("window", _I32), ("rep", _I32), ("sinks", _I32),
    ("pages_per_split", _I32), ("num_splits", _I32), ("batch", _I32), ("kv_heads", _I32), ("head_tables", _I32),
)


class DecodeParams(ctypes.Structure):
    _fields_ = list(FIELDS)


class KernelLibraries:
    """The libraries of one kernel's variants, built on first use (build(*args), hack_ops.cuda.build)
    and loaded once per process each, by name, through hack_ops.cbuild.LibraryCache (a failed build is
    reported once and not retried). `what` names the kernel in the error."""

    def __init__(self, what: str, build: Callable[..., Path], declare: Callable[[ctypes.CDLL], None]) -> None:
        self.what = what
        self._args: dict[str, tuple] = {}  # filled before LibraryCache.load asks for the build
        self.cache = LibraryCache(lambda name: build(*self._args[name]), declare)

    def load(self, name: str, *args: Any) -> ctypes.CDLL:
        """The library `name`, built with build(*args) if needed; RuntimeError with the reason when
        that is impossible (no nvcc, a compile error)."""
        self._args[name] = args
        lib = self.cache.load(name)
        if lib is None:
            raise RuntimeError(f"{self.what} ({name}) is unavailable: {self.cache.errors.get(name)}")
        return lib


def _declare(lib: ctypes.CDLL) -> None:
    lib.hack_cuda_decode.argtypes = [ctypes.POINTER(DecodeParams), ctypes.c_int, ctypes.c_void_p]
    lib.hack_cuda_decode.restype = ctypes.c_int
    lib.hack_cuda_variant.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.hack_cuda_variant.restype = None
    lib.hack_cuda_kernel_attributes.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    lib.hack_cuda_kernel_attributes.restype = ctypes.c_int
    lib.hack_cuda_error_string.argtypes = [ctypes.c_int]
    lib.hack_cuda_error_string.restype = ctypes.c_char_p


LIBS = KernelLibraries("the CUDA decode kernel", library, _declare)


def key(variant: Variant, arch: int) -> str:
    return f"{variant.name}@sm{arch}"


def load(variant: Variant, arch: int) -> ctypes.CDLL:
    """The library of `variant` for sm_<arch>, built if needed; RuntimeError with the reason when
    that is impossible (no nvcc, a compile error)."""
    return LIBS.load(key(variant, arch), variant, arch)


def built_variant(lib: ctypes.CDLL) -> dict[str, int]:
    """What a loaded library says it was built for (and the struct size it expects)."""
    out = (ctypes.c_int64 * 6)()
    lib.hack_cuda_variant(out)
    return dict(zip(("head_dim", "dtype", "order", "cap", "smem", "params_size"), out))


def kernel_attributes(lib: ctypes.CDLL, device: int) -> dict[str, int]:
    """The driver's view of a loaded kernel on `device` (needs a GPU): registers, spill bytes,
    static shared bytes, resident blocks per SM."""
    out = (ctypes.c_int64 * 4)()
    err = lib.hack_cuda_kernel_attributes(device, out)
    if err:
        raise RuntimeError(f"cudaFuncGetAttributes failed: {lib.hack_cuda_error_string(err).decode()}")
    return dict(zip(("regs", "local_bytes", "static_shared", "blocks_per_sm"), out))
