"""The compiled page store (csrc/hack_store.c): ctypes binding, coverage, and the summation check.

One call stores one layer of a forward batch: sinks, FP16 tail appends, and every page that
closes (K per channel with the range search, V per token, K's code sums, packing), with
OpenMP over (page, KV head). It is built into the CPU kernel's library (cpu_kernel.SOURCES,
same flags: -march=native where possible, a portable variant too) and leaves the same bytes
as the PyTorch reference store (write.py); HackKVStore.write picks it under backend 'auto'.

Byte identity rests on doing quant.quantize's float32 operations in the same order. The one
order that is torch's choice rather than the formula's is the sum of squared errors in the
range search (torch's CPU sum kernel: blocks of 16 rows along a strided dim, vectors of W lanes
along a contiguous one). The C code reproduces both; `summation_order()` checks them once per
process against this torch build (and finds W), and the store refuses range search where they
do not match, rather than write different bytes.

Not covered (HackKVStore.write falls back to the PyTorch store; `why_not` says why):
orientation 'token_k', stochastic rounding, requant_elimination=False, head_dim not a multiple
of 64 up to 256, a store off the CPU. HACK_CPU_STORE=0 (or HACK_CPU_KERNEL=0) disables it.
"""
from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..config import OpenMode
from . import cpu_kernel
from .plan import ForwardPlan

if TYPE_CHECKING:  # pragma: no cover
    from .write import KVBuffers

_I64 = ctypes.c_int64
_P = ctypes.c_void_p
_IN_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
SUM_ROWS, SUM_INNER = 0, 1


class _Args(ctypes.Structure):
    _fields_ = [(n, _I64) for n in (
        "batch", "heads", "head_dim", "page_size", "k_bits", "v_bits", "group", "sink_tokens",
        "meta_fp32", "v_tail", "range_search", "in_dtype", "inner_width", "max_pages", "nthreads",
        "k_page_bytes", "k_codes_off", "k_min_off", "k_scale_off", "k_sums_off", "k_sums_bytes",
        "v_page_bytes", "v_codes_off", "v_min_off", "v_scale_off")] + [
        (n, _P) for n in ("qo_indptr", "prefix_lens", "rows", "page_table", "sink_slots", "k", "v",
                          "k_pages", "v_pages", "tail_k", "tail_v", "sink_k", "sink_v")]


_bound: dict[str, ctypes.CDLL | None] = {}
_order: dict[str, int | None] = {}


def load(variant: str = "native") -> ctypes.CDLL | None:
    """The kernel library with the store's entry points typed (None if it cannot be loaded)."""
    if variant in _bound:
        return _bound[variant]
    lib = cpu_kernel.load(variant)
    if lib is not None:
        lib.hack_store.argtypes = [ctypes.POINTER(_Args)]
        lib.hack_store.restype = ctypes.c_int
        lib.hack_store_sum.argtypes = [_P, _I64, _I64, _I64, _I64, _P]
        lib.hack_store_sum.restype = ctypes.c_int
        lib.hack_append_tails.argtypes = [_P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _I64]
        lib.hack_append_tails.restype = ctypes.c_int
    _bound[variant] = lib
    return lib


def c_sum(e: Tensor, order: int, width: int = 8, variant: str = "native") -> Tensor:
    """The C store's column sums of e [n, cols] (float32) in `order` (SUM_ROWS / SUM_INNER)."""
    lib = load(variant)
    if lib is None:
        raise RuntimeError("the compiled store is not available")
    e = e.float().contiguous()
    out = torch.empty(e.shape[1], dtype=torch.float32)
    if lib.hack_store_sum(e.data_ptr(), e.shape[0], e.shape[1], order, width, out.data_ptr()) != 0:
        raise RuntimeError("hack_store_sum rejected its arguments")
    return out


def _spread(shape: tuple[int, ...], g: torch.Generator) -> Tensor:
    """Non-negative float32 values over many binades, so that summation orders differ."""
    return (torch.randn(shape, generator=g) * torch.exp(3 * torch.randn(shape, generator=g))) ** 2


def summation_order(variant: str = "native") -> int | None:
    """The vector width W of torch's contiguous sum for which the C store's sums equal torch's
    for both layouts the reference reduces, or None when no width reproduces them."""
    if variant in _order:
        return _order[variant]
    g = torch.Generator().manual_seed(0)
    # K per channel: content [C, Π, H, D] summed over Π (a strided dim), as quantize() does
    x = _spread((4, 64, 2, 64), g)
    want = x.movedim(1, -1).sum(-1)  # [C, H, D]
    rows_ok = all(torch.equal(c_sum(x[c].reshape(64, -1), SUM_ROWS, 8, variant), want[c].reshape(-1))
                  for c in range(x.shape[0]))
    found = None
    if rows_ok:
        for width in (8, 16, 4, 32):  # V per token: head_dim groups summed along the contiguous dim
            if all(torch.equal(c_sum(y.t(), SUM_INNER, width, variant), y.sum(-1))
                   for y in (_spread((256, n), g) for n in (32, 64, 128, 256))):
                found = width
                break
    _order[variant] = found
    return found


def why_not(store: "KVBuffers", generator: torch.Generator | None = None, variant: str = "native") -> str | None:
    """Why the compiled store cannot run for this store (None: it can)."""
    cfg = store.config
    d = store.head_dim
    if os.environ.get("HACK_CPU_STORE", "1") == "0":
        return "disabled by HACK_CPU_STORE=0"
    if os.environ.get("HACK_CPU_KERNEL", "1") == "0":
        return "disabled by HACK_CPU_KERNEL=0"
    if store.device.type != "cpu":
        return f"the store is on {store.device}, not the CPU"
    if cfg.orientation != "channel_k":
        return "orientation 'token_k' (the compiled store does 'channel_k')"
    if cfg.rounding != "nearest" or generator is not None:
        return "stochastic rounding (the compiled store rounds to nearest)"
    if not cfg.requant_elimination:
        return "requant_elimination=False (each write re-quantizes the open page: the PyTorch store does it)"
    if d % 64 or d > 256:
        return f"head_dim {d} (the compiled store needs a multiple of 64 up to 256)"
    if load(variant) is None:
        return cpu_kernel.why_not_loaded(variant)
    if cfg.range_search and summation_order(variant) is None:
        return ("range search: this torch build sums squared errors in an order the compiled store does not "
                "reproduce, so its pages could differ from the reference's")
    return None


def write(store: "KVBuffers", layer: int, plan: ForwardPlan, k: Tensor, v: Tensor, variant: str = "native") -> None:
    """Store checked k, v [N, H, D] of one layer (the caller checked why_not and the input)."""
    lib = load(variant)
    if lib is None:
        raise RuntimeError(cpu_kernel.why_not_loaded(variant))
    cfg, lay = store.config_for(layer), store.layout_for(layer)
    if k.dtype not in _IN_DTYPES or v.dtype != k.dtype:
        k, v = k.float(), v.float()
    k, v = k.contiguous(), v.contiguous()
    meta = [t.contiguous() for t in (plan.qo_indptr, plan.prefix_lens, plan.rows, plan.page_table, plan.sink_slot)]
    qo, pre, rows, table, sinks = (t.to(torch.int64) if t.dtype != torch.int64 else t for t in meta)
    tail_k, tail_v = store.tail("k", layer), store.tail("v", layer)
    v_tail = cfg.open_mode("v") == OpenMode.FP16
    width = summation_order(variant) if cfg.range_search else 8
    sums = lay.k.sums
    a = _Args(
        batch=plan.batch_size, heads=store.num_heads, head_dim=store.head_dim, page_size=cfg.partition_size,
        k_bits=lay.k.bits, v_bits=lay.v.bits, group=cfg.head_group(store.head_dim), sink_tokens=cfg.sink_tokens,
        meta_fp32=int(cfg.meta_dtype == "float32"), v_tail=int(v_tail), range_search=int(cfg.range_search),
        in_dtype=_IN_DTYPES[k.dtype], inner_width=width or 8, max_pages=table.shape[1],
        nthreads=torch.get_num_threads(),
        k_page_bytes=lay.k.page_bytes, k_codes_off=lay.k.codes.offset, k_min_off=lay.k.minimum.offset,
        k_scale_off=lay.k.scale.offset, k_sums_off=sums.offset,
        k_sums_bytes=torch.tensor([], dtype=sums.dtype).element_size(),
        v_page_bytes=lay.v.page_bytes, v_codes_off=lay.v.codes.offset, v_min_off=lay.v.minimum.offset,
        v_scale_off=lay.v.scale.offset,
        qo_indptr=qo.data_ptr(), prefix_lens=pre.data_ptr(), rows=rows.data_ptr(), page_table=table.data_ptr(),
        sink_slots=sinks.data_ptr(), k=k.data_ptr(), v=v.data_ptr(),
        k_pages=store.k_pages[layer].data_ptr(), v_pages=store.v_pages[layer].data_ptr(),
        tail_k=tail_k.data_ptr(), tail_v=None if not v_tail else tail_v.data_ptr(),
        sink_k=store.sink_k[layer].data_ptr(), sink_v=store.sink_v[layer].data_ptr(),
    )
    rc = lib.hack_store(ctypes.byref(a))
    if rc != 0:
        raise RuntimeError(f"the compiled store rejected the call ({'geometry' if rc == 1 else 'out of memory'})")


def _tail_slots(plan: ForwardPlan) -> tuple[Tensor, Tensor, bool]:
    """Each new token's tail row and slot (int64, contiguous), and whether the environment lets
    the compiled append run, once per plan (every layer's store step asks; reading the
    environment alone cost ~15 us a call from cold caches)."""
    got = plan.memo.get("tail_slots")
    if got is None:
        on = os.environ.get("HACK_CPU_STORE", "1") != "0" and os.environ.get("HACK_CPU_KERNEL", "1") != "0"
        got = plan.memo["tail_slots"] = (plan.tok_row.to(torch.int64).contiguous(),
                                         plan.tok_off.to(torch.int64).contiguous(), on)
    return got


def _token_rows(x: Tensor) -> bool:
    """Whether each token's [H, D] values of x [N, H, D] are contiguous (tokens any stride apart,
    as in a view of a fused QKV projection's output)."""
    _, h, d = x.shape
    return (x.stride(2) == 1 or d == 1) and (x.stride(1) == d or h == 1) and (x.stride(0) >= h * d or x.shape[0] <= 1)


def append_tails(store: "KVBuffers", layer: int, plan: ForwardPlan, k: Tensor, v: Tensor,
                 variant: str = "native") -> bool:
    """write.append_to_tails in one compiled call, finiteness checked there (ValueError naming
    the tensor; nothing written): the store step of most decode steps. False (nothing done)
    where it does not apply: the compiled library disabled (HACK_CPU_STORE=0 or HACK_CPU_KERNEL=0,
    read once per plan) or missing, an input dtype or layout it does not read (the caller then
    checks and writes with torch)."""
    rows, offs, on = _tail_slots(plan)
    if not on:
        return False
    lib = load(variant)
    dt = _IN_DTYPES.get(k.dtype)
    tail_k, tail_v = store.tail("k", layer), store.tail("v", layer)
    if (lib is None or dt is None or v.dtype is not k.dtype or tail_k is None or tail_v is None
            or not (_token_rows(k) and _token_rows(v) and tail_k.is_contiguous() and tail_v.is_contiguous())):
        return False
    hd = store.num_heads * store.head_dim
    rc = lib.hack_append_tails(k.data_ptr(), v.data_ptr(), dt, k.shape[0], hd, tail_k.shape[1], rows.data_ptr(),
                               offs.data_ptr(), tail_k.data_ptr(), tail_v.data_ptr(),
                               k.stride(0) if k.shape[0] > 1 else hd, v.stride(0) if v.shape[0] > 1 else hd)
    if rc in (-3, -4):
        raise ValueError(f"{'k' if rc == -3 else 'v'} contains NaN or inf; nothing was written")
    if rc != 0:
        raise RuntimeError("the compiled tail append rejected its arguments")
    return True
