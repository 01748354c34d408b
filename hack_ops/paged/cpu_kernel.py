"""The compiled CPU kernels (csrc/: hack_decode.c, hack_pages.c; hack_extend.c, bound in
cpu_extend.py; hack_store.c, bound in cpu_store.py; hack_select.c, bound in sparse.py): build,
load, call the attention kernel.

Plain C (no torch headers, so it builds in about a second) compiled with the machine's
gcc: `-O3 -march=native` (AVX-512 VNNI where the CPU has it) into a cache directory keyed by
the source, flags and compiler, then loaded with ctypes; it reads the store's buffers in
place. `scripts/install.sh` builds it ahead of time (`python -m hack_ops.paged.cpu_kernel
build`); otherwise the first decode builds it. Without a compiler, or for what the kernel does
not cover, decode falls back to the portable PyTorch path ('auto'), or raises ('cpu').

Covered: orientation 'channel_k', nearest rounding, 2 or 4 bits for K and for V (each its own), head_dim a multiple of 64 up
to 256, up to 16 query heads per KV head, sliding windows and logit soft-capping; decode 'hack'
with any tails / sinks / RQE setting; extend 'hack' (RQE on), prefill 'homomorphic' or 'exact' (the
latter with K and V tails, RQE on):
the tiled kernel of hack_extend.c (bound in cpu_extend.py), or this file's per-query call (one
kernel "request" per new token); both with windows and soft-caps.
Environment: HACK_CPU_KERNEL=0 disables it; HACK_KERNEL_CACHE sets the cache directory.
"""
from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import torch

from ..cbuild import LibraryCache, build_library
from ..config import OpenMode
from ..modes import AttentionMode, PrefillMode

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "hack_decode.c", CSRC / "hack_pages.c", CSRC / "hack_extend.c", CSRC / "hack_store.c",
           CSRC / "hack_select.c"]
HEADERS = [CSRC / "hack_kernel.h"]
VARIANTS = {
    "native": ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
    "portable": ["-O3", "-ffp-contract=off", "-fopenmp"],  # no SIMD intrinsics: the plain C loops
}
_I64 = ctypes.c_int64
_P = ctypes.c_void_p


# Argument fields the decode (hack_args) and extend (hack_xargs) structs of csrc/ share, in
# their C order: the model's geometry and format, then where each part of a page lies.
GEOMETRY_FIELDS = ("batch", "heads", "rep", "head_dim", "page_size", "k_bits", "v_bits", "group", "sink_tokens")
PAGE_FIELDS = ("k_page_bytes", "k_codes_off", "k_min_off", "k_scale_off", "k_sums_off", "k_sums_bytes",
               "v_page_bytes", "v_codes_off", "v_min_off", "v_scale_off", "nthreads")


class _Args(ctypes.Structure):
    _fields_ = [(n, _I64) for n in (
        *GEOMETRY_FIELDS, "k_open_quantized", "v_open_quantized", "meta_fp32", "max_pages",
        *PAGE_FIELDS, "window", "head_tables")] + [
        ("logit_cap", ctypes.c_double)] + [
        (n, _P) for n in ("seq_lens", "n_closed", "page_table", "table_rows", "sink_slots", "k_open_off",
                          "v_open_off", "k_pages", "v_pages", "k_open", "v_open", "sink_k", "sink_v", "q", "out")] + [
        ("q_dtype", _I64), ("q_scale", ctypes.c_double), ("out_dtype", _I64)]

# the query dtypes hack_decode converts (and scales) itself, by its q_dtype codes
Q_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# the output dtypes it writes, by its out_dtype codes (others: float32, then converted by torch)
OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def build(variant: str = "native") -> Path:
    """Compile (if not cached) and return the shared library's path; RuntimeError on failure."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    return build_library(f"hack_decode_{variant}", SOURCES, HEADERS, VARIANTS[variant], "the CPU kernel",
                         libs=["-lm"])


def _declare(lib: ctypes.CDLL) -> None:
    lib.hack_decode.argtypes = [ctypes.POINTER(_Args)]
    lib.hack_decode.restype = ctypes.c_int
    lib.hack_decode_simd.restype = ctypes.c_int


_cache = LibraryCache(build, _declare)
_errors = _cache.errors


def load(variant: str = "native") -> ctypes.CDLL | None:
    """The loaded library, building it on first use; None (reason in why_not) if impossible."""
    return _cache.load(variant)


def why_not(store, mode: AttentionMode | str, generator=None, variant: str = "native", phase: str = "decode",
            window: int | None = None, logit_cap: float = 0.0,
            prefill: PrefillMode | str = PrefillMode.HOMOMORPHIC) -> str | None:
    """Why the kernel cannot run this call (None: it can). phase: 'decode' or 'extend' (with
    the extend's PrefillMode).
    window / logit_cap: the layer's features; this kernel has both (a kernel without them
    returns its reason here, and the dispatcher falls back to a path that has them)."""
    if os.environ.get("HACK_CPU_KERNEL", "1") == "0":
        return "disabled by HACK_CPU_KERNEL=0"
    # what the store's format and the call's kind decide, looked up once (every layer of every
    # step asks); whether the library loads is asked each time
    memo = store.__dict__.setdefault("_kernel_refusals", {})
    key = (mode, generator is None, phase, prefill)
    if key not in memo:
        memo[key] = _format_refusal(store, mode, generator, phase, prefill)
    reason = memo[key]
    if reason is not None:
        return reason
    if load(variant) is None:
        return why_not_loaded(variant)
    return None


def _format_refusal(store, mode: AttentionMode | str, generator, phase: str, prefill: PrefillMode | str) -> str | None:
    """why_not's answer from the store and the call's kind alone."""
    cfg = store.config
    d = store.head_dim
    if store.device.type != "cpu":
        return f"the store is on {store.device}, not the CPU"
    if mode != AttentionMode.HACK:
        return f"mode {str(mode)!r} (the kernel does 'hack' decode and extend)"
    if cfg.orientation != "channel_k":
        return "orientation 'token_k' (the kernel does 'channel_k')"
    if cfg.rounding != "nearest" or generator is not None:
        return "stochastic rounding (the kernel rounds to nearest)"
    if d % 64 or d > 256 or d // cfg.head_group(d) > 16:
        return f"head_dim {d} (the kernel needs a multiple of 64 up to 256)"
    if phase == "extend" and cfg.open_mode("k") == OpenMode.REQUANT:
        return "extend with requant_elimination=False (each query needs its own re-quantized page)"
    if phase == "extend" and prefill == PrefillMode.EXACT and cfg.open_mode("v") != OpenMode.FP16:
        return "prefill 'exact' without a V tail"
    return None


def why_not_loaded(variant: str = "native") -> str:
    """Why load(variant) gave None (building or loading the library failed)."""
    return _errors.get(variant, "the kernel could not be loaded")


def usable(store, mode: AttentionMode | str, backend: str, generator=None, phase: str = "decode",
           window: int | None = None, logit_cap: float = 0.0) -> bool:
    return backend in ("auto", "cpu") and why_not(store, mode, generator, phase=phase, window=window,
                                                  logit_cap=logit_cap) is None


def shared_args(store, layer: int, q: torch.Tensor, max_pages: int) -> dict[str, int]:
    """The values of both kernels' shared argument fields (all but batch) for queries q
    [N, Hq, D] of `layer` (its bits and page layout); RuntimeError for more query heads per KV
    head than the kernels take."""
    cfg, lay = store.config_for(layer), store.layout_for(layer)
    d = q.shape[2]
    rep = q.shape[1] // store.num_heads
    if rep > 16:
        raise RuntimeError(f"{rep} query heads per KV head (the kernel takes up to 16)")
    return dict(
        heads=store.num_heads, rep=rep, head_dim=d, page_size=cfg.partition_size,
        k_bits=lay.k.bits, v_bits=lay.v.bits, group=cfg.head_group(d), sink_tokens=cfg.sink_tokens,
        v_open_quantized=int(cfg.open_mode("v") != OpenMode.FP16),
        meta_fp32=int(cfg.meta_dtype == "float32"), max_pages=max_pages,
        k_page_bytes=lay.k.page_bytes, k_codes_off=lay.k.codes.offset, k_min_off=lay.k.minimum.offset,
        k_scale_off=lay.k.scale.offset, k_sums_off=lay.k.sums.offset,
        k_sums_bytes=torch.tensor([], dtype=lay.k.sums.dtype).element_size(),
        v_page_bytes=lay.v.page_bytes, v_codes_off=lay.v.codes.offset, v_min_off=lay.v.minimum.offset,
        v_scale_off=lay.v.scale.offset, nthreads=torch.get_num_threads())


def check_contiguous(*bufs: torch.Tensor | None) -> None:
    if any(t is not None and not t.is_contiguous() for t in bufs):
        raise RuntimeError("the buffers the kernel reads must be contiguous")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _i64(x) -> torch.Tensor:
    return torch.as_tensor(x).to(torch.int64).contiguous()


class _LayerArgs:
    """A layer's decode arguments that stay fixed while its buffers do (geometry, format, page
    layout, the pages and sinks), built once: a served layer starts from cold caches, where
    building them anew (a dict of two dozen fields, a few torch calls) cost tens of microseconds
    a call."""

    __slots__ = ("args", "bufs")

    def __init__(self, args: _Args, bufs: tuple) -> None:
        self.args, self.bufs = args, bufs


def _layer_args(store, layer: int, q: torch.Tensor) -> _Args:
    """The decode arguments of `layer` for queries shaped like q that no call changes (max_pages,
    nthreads and the per-call fields are set by the caller on a copy)."""
    cache = store.__dict__.setdefault("_decode_layer_args", {})
    key = (layer, q.shape[1], q.shape[2])
    bufs = (store.k_pages[layer], store.v_pages[layer], store.sink_k[layer], store.sink_v[layer])
    got = cache.get(key)
    if got is not None and all(x is y for x, y in zip(got.bufs, bufs)):
        return got.args
    check_contiguous(*bufs)
    shared = shared_args(store, layer, q, 0)
    args = _Args(**shared, k_open_quantized=int(store.config.open_mode("k") != OpenMode.FP16),
                 k_pages=_ptr(bufs[0]), v_pages=_ptr(bufs[1]), sink_k=_ptr(bufs[2]), sink_v=_ptr(bufs[3]))
    cache[key] = _LayerArgs(args, bufs)
    return args


def attend(store, layer: int, q: torch.Tensor, scale: float, seq_lens, n_closed, page_table, table_rows,
           sink_slots, k_open: torch.Tensor | None, k_open_off, v_open: torch.Tensor | None, v_open_off,
           variant: str = "native", window: int | None = None, logit_cap: float = 0.0,
           head_tables: bool = False) -> torch.Tensor:
    """One query per row of q [N, Hq, D] at position seq_lens[i]-1: pages < n_closed[i] of
    page_table[table_rows[i]] (head_tables: page_table is [rows * H, pages], KV head h of
    query i reading row table_rows[i] * H + h; no window then) read from codes, pages from n_closed[i] on from the FP16 tokens
    at k_open/v_open (fp16 [.., H, D], element offsets *_open_off[i]) unless the config reads
    them quantized. window (keys t-window..t, None: all) and logit_cap (0: none) are the layer's.
    Returns float32 [N, Hq, D]."""
    seq, ncl, table, trows, sinks, koff, voff = (
        _i64(x) for x in (seq_lens, n_closed, page_table, table_rows, sink_slots, k_open_off, v_open_off))
    return _attend_i64(store, layer, q, scale, seq, ncl, table, trows, sinks, k_open, koff, v_open, voff, variant,
                       window, logit_cap, head_tables)


def _attend_i64(store, layer: int, q: torch.Tensor, scale: float, seq: torch.Tensor, ncl: torch.Tensor,
                table: torch.Tensor, trows: torch.Tensor, sinks: torch.Tensor, k_open: torch.Tensor | None,
                koff: torch.Tensor, v_open: torch.Tensor | None, voff: torch.Tensor, variant: str,
                window: int | None, logit_cap: float, head_tables: bool,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """attend() on int64, contiguous index tensors (what its callers hold already); the output
    in out_dtype."""
    lib = load(variant)
    if lib is None:
        raise RuntimeError(_errors.get(variant, "the CPU kernel is not available"))
    n, hq, d = q.shape
    a = _Args.from_buffer_copy(_layer_args(store, layer, q))
    check_contiguous(k_open, v_open)
    code = Q_DTYPES.get(q.dtype)
    if code is None or not q.is_contiguous():  # the kernel converts float32 / bf16 / fp16 itself
        q, code = q.float().contiguous(), 0
    out_code = OUT_DTYPES.get(out_dtype)
    out = torch.empty(n, hq, d, dtype=torch.float32 if out_code is None else out_dtype)
    a.batch, a.max_pages, a.nthreads, a.out_dtype = n, table.shape[1], torch.get_num_threads(), out_code or 0
    a.window = -1 if window is None else int(window)
    a.logit_cap, a.head_tables = float(logit_cap or 0.0), int(head_tables)
    a.seq_lens, a.n_closed = seq.data_ptr(), ncl.data_ptr()
    a.page_table, a.table_rows = table.data_ptr(), trows.data_ptr()
    a.sink_slots, a.k_open_off, a.v_open_off = sinks.data_ptr(), koff.data_ptr(), voff.data_ptr()
    a.k_open, a.v_open = _ptr(k_open), _ptr(v_open)
    a.q, a.q_dtype, a.q_scale, a.out = q.data_ptr(), code, float(scale), out.data_ptr()
    rc = lib.hack_decode(ctypes.byref(a))
    if rc == -2:
        raise MemoryError("the CPU decode kernel could not allocate its work items")
    if rc != 0:
        raise RuntimeError("the CPU kernel rejected the geometry (or a query with no key to attend)")
    return out if out_code is not None else out.to(out_dtype)


def _plan_inputs(store, plan) -> tuple[torch.Tensor, ...]:
    """The decode kernel's index inputs of a plan (int64, contiguous: lengths, closed pages, page
    table, table rows, sink slots, tail offsets), built once per plan: every layer of a forward
    reads the same."""
    key = ("cpu_decode_inputs", id(store))
    got = plan.memo.get(key)
    if got is None:
        p = store.page_size
        seq = _i64(plan.seq_lens)
        off = plan.rows.to(torch.int64) * (p * store.num_heads * store.head_dim)  # each request's tail row
        got = plan.memo[key] = (seq, _i64(seq // p), _i64(plan.page_table), torch.arange(plan.batch_size),
                                _i64(plan.sink_slot.clamp(min=0)), off.contiguous())
    return got


def decode(store, layer: int, plan, q: torch.Tensor, scale: float, variant: str = "native",
           window: int | None = None, logit_cap: float = 0.0, selection=None,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode attention for the plan's batch (one query per request): [B, Hq, D] in out_dtype
    (float32 by default; bfloat16 written by the kernel, others converted from float32).
    selection (hack_ops.paged.sparse.PageSelection): read only the selected pages, each KV
    head its own (sparse decode: the shortened sequences, through per-head page tables)."""
    seq, ncl, table, trows, sinks, off = _plan_inputs(store, plan)
    per_head = False
    if selection is not None:
        if window is not None:
            raise ValueError("sparse decode does not apply to a sliding-window layer (its window bounds the pages)")
        seq, ncl, table = selection.kernel_inputs()
        per_head = True
    return _attend_i64(store, layer, q, scale, seq, ncl, table, trows, sinks, store.tail("k", layer), off,
                       store.tail("v", layer), off, variant, window, logit_cap, per_head, out_dtype)


def simd(variant: str = "native") -> bool:
    lib = load(variant)
    return bool(lib is not None and lib.hack_decode_simd())


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        print("usage: python -m hack_ops.paged.cpu_kernel build", file=sys.stderr)
        sys.exit(2)
    try:
        for v in VARIANTS:
            print(f"{v}: {build(v)}")
        print(f"AVX-512 VNNI path: {'yes' if simd() else 'no (plain C loops)'}")
    except RuntimeError as exc:  # not fatal: decode falls back to the PyTorch path
        print(f"warning: {exc}", file=sys.stderr)
