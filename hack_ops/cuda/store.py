"""The prefill store on CUDA (csrc/hack_store.cu): the pages a batch of new tokens closes,
quantized once each, and the sink tokens among them, in the bytes hack_ops.quant defines (the CPU
store's and the Triton store's). The open page's tokens go to the FP16 tails by the Triton store's
tail phase, so `store()` is the drop-in for hack_ops.triton.store.store(phase='all') on the
formats `store_why_not` accepts.

Why a CUDA kernel for this: the Triton store tiles a page per program at 254 registers (one
block per SM), and on an H200 it took ~0.8 ms for a 2K-token prompt's layer, 4x the BF16 flash
prefill it sits beside (docs/kernels.md). Here each group's 25-candidate range search is one
thread's, in registers.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor

from ..layout import PageLayout
from ..triton.batch import PagedBatch
from ..triton.spec import CacheArgs, cache_args
from .build import ActDtype, Variant, device_arch, store_library, store_name
from .fragment import HEAD_DIMS, PAGE
from .launch import KernelLibraries

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32

FIELDS = (
    ("k", _P), ("v", _P), ("k_tok", _I64), ("k_head", _I64), ("v_tok", _I64), ("v_head", _I64),
    ("qo_indptr", _P), ("prefix_lens", _P), ("kv_indptr", _P), ("kv_indices", _P), ("tail_rows", _P),
    ("sink_slots", _P), ("k_buf", _P), ("v_buf", _P), ("k_page", _I64), ("v_page", _I64),
    ("kc_off", _I64), ("km_off", _I64), ("ks_off", _I64), ("ksum_off", _I64),
    ("vc_off", _I64), ("vm_off", _I64), ("vs_off", _I64),
    ("tail_k", _P), ("tail_v", _P), ("t_row", _I64), ("t_tok", _I64), ("t_head", _I64),
    ("sink_k", _P), ("sink_v", _P), ("s_slot", _I64), ("s_tok", _I64), ("s_head", _I64),
    ("batch", _I32), ("heads", _I32), ("max_touched", _I32), ("k_bits", _I32), ("v_bits", _I32),
    ("sinks", _I32), ("meta_bytes", _I32), ("sum_bytes", _I32), ("range_search", _I32), ("sum_width", _I32),
)
STORE_BITS = (2, 4)
INPUT_DTYPES = {torch.bfloat16: ActDtype.BF16, torch.float16: ActDtype.FP16}


class StoreParams(ctypes.Structure):
    _fields_ = list(FIELDS)


SUM_WIDTHS = (8, 16)  # the kernel's instantiations of the reference's V error sum
_sum_width: list[int] = []


def _inner_sum(e: Tensor, w: int) -> Tensor:
    """Row sums of e [rows, 64] in the order csrc/hack_store.cu's sum_inner<w> adds them."""
    n = e.shape[1]
    nvec = n // w
    head = nvec // 4 * 4 * w
    total = torch.zeros(e.shape[0], dtype=e.dtype)
    for lane in range(w):
        acc = torch.zeros_like(total)
        for k in range(4):
            part = torch.zeros_like(total)
            for i in range(k * w + lane, head, 4 * w):
                part = part + e[:, i]
            if k == 0:
                for i in range(head + lane, nvec * w, w):
                    part = part + e[:, i]
            acc = part if k == 0 else acc + part
        total = total + acc
    return total


def reference_sum_width() -> int:
    """The vector width of torch's CPU sum over a contiguous 64-value row on this host: the order
    of the reference's V range-search errors (hack_ops.quant), which the kernel reproduces so two
    candidates that tie to the last bit resolve as the reference does. 8 where no width of
    SUM_WIDTHS reproduces it (the bytes may then differ from the CPU store's on such ties)."""
    if not _sum_width:
        g = torch.Generator().manual_seed(0)
        e = (torch.randn(4096, 64, generator=g) * torch.exp(3 * torch.randn(4096, 64, generator=g))) ** 2
        want = e.sum(-1)
        found = [w for w in SUM_WIDTHS if torch.equal(_inner_sum(e, w), want)]
        _sum_width.append(found[0] if found else SUM_WIDTHS[0])
    return _sum_width[0]


def store_why_not(layout: PageLayout, dtype: torch.dtype) -> str | None:
    """None when the CUDA store writes this layer's pages from `dtype` tokens, else the reason
    (the Triton store writes them then)."""
    cfg = layout.config
    checks = (
        (cfg.orientation == "channel_k", f"orientation {cfg.orientation!r} (the kernel writes 'channel_k')"),
        (cfg.rounding == "nearest", f"rounding {cfg.rounding!r}"),
        (layout.page_size == PAGE, f"page size {layout.page_size} (the kernel writes Π = {PAGE})"),
        (layout.head_dim in HEAD_DIMS, f"head_dim {layout.head_dim} (the kernel covers {HEAD_DIMS})"),
        (cfg.bits("k") in STORE_BITS and cfg.bits("v") in STORE_BITS,
         f"{cfg.bits('k')}-bit K / {cfg.bits('v')}-bit V codes (the kernel writes {STORE_BITS})"),
        (cfg.v_tail and cfg.k_tail, f"tail_tensors {cfg.tail_tensors!r} (the kernel closes pages from FP16 tails)"),
        (layout.version == 2 and layout.v.sums is None and layout.k.sums is not None,
         f"page layout version {layout.version}"),
        (not cfg.k_outlier_channels, "k_outlier_channels (reference only)"),
        (cfg.sink_tokens <= PAGE, f"{cfg.sink_tokens} sink tokens (at most one page)"),
        (dtype in INPUT_DTYPES, f"{dtype} tokens (the kernel reads bf16 or fp16)"),
    )
    for ok, why in checks:
        if not ok:
            return why
    return None


def _declare(lib: ctypes.CDLL) -> None:
    lib.hack_cuda_store.argtypes = [ctypes.POINTER(StoreParams), ctypes.c_int, ctypes.c_void_p]
    lib.hack_cuda_store.restype = ctypes.c_int
    lib.hack_cuda_store_variant.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.hack_cuda_store_variant.restype = None
    lib.hack_cuda_store_attributes.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    lib.hack_cuda_store_attributes.restype = ctypes.c_int
    lib.hack_cuda_store_error_string.argtypes = [ctypes.c_int]
    lib.hack_cuda_store_error_string.restype = ctypes.c_char_p


LIBS = KernelLibraries("the CUDA store kernel", store_library, _declare)


def load(variant: Variant, arch: int) -> ctypes.CDLL:
    """The store library for `variant`'s head_dim and dtype on sm_<arch>, built if needed;
    RuntimeError with the reason when that is impossible."""
    return LIBS.load(f"{store_name(variant)}@sm{arch}", variant, arch)


def kernel_attributes(lib: ctypes.CDLL, device: int) -> dict[str, int]:
    """The driver's view of the loaded store kernel (needs a GPU)."""
    out = (ctypes.c_int64 * 4)()
    err = lib.hack_cuda_store_attributes(device, out)
    if err:
        raise RuntimeError(f"cudaFuncGetAttributes failed: {lib.hack_cuda_store_error_string(err).decode()}")
    return dict(zip(("regs", "local_bytes", "static_shared", "blocks_per_sm"), out))


@dataclass
class StoreCall:
    """A checked pages-phase store: the library variant and its argument struct (None: nothing
    to write), and the tensors the struct points into that nothing else holds."""

    variant: Variant
    params: StoreParams | None
    keep: tuple


def _aligned(t: Tensor) -> Tensor:
    """V rows are read as 16-byte vectors: rows of 8-element multiples, 16-byte aligned."""
    if t.stride(-1) != 1 or t.stride(0) % 8 or t.stride(1) % 8 or t.data_ptr() % 16:
        return t.contiguous()
    return t


def prepare(layout: PageLayout, batch: PagedBatch, k: Tensor, v: Tensor, k_buf: Tensor, v_buf: Tensor,
            tail_k: Tensor, tail_v: Tensor | None, sink_k: Tensor | None, sink_v: Tensor | None) -> StoreCall:
    """Check a pages-phase store's arguments (all on k's device) and fill the argument struct;
    the launch is store_pages()'s (or the CPU harness's, hack_ops.cuda.simt.store_on_cpu)."""
    why = store_why_not(layout, k.dtype)
    if why is not None:
        raise NotImplementedError(f"the CUDA store does not write this layer: {why}")
    from ..triton.store import check_tokens

    shape = (batch.total_new, layout.num_heads, layout.head_dim)
    check_tokens("k", k, shape)
    check_tokens("v", v, shape)
    if v.dtype != k.dtype:
        raise ValueError(f"k and v must have one dtype, got {k.dtype} and {v.dtype}")
    cache = cache_args(layout, k_buf, v_buf, tail_k, tail_v, sink_k, sink_v)
    for name, t in (("v", v), ("k_buf", k_buf), ("v_buf", v_buf), ("tail_k", cache.tail_k), ("tail_v", cache.tail_v),
                    ("sink_k", cache.sink_k), ("sink_v", cache.sink_v), ("page table", batch.kv_indices)):
        if t.device != k.device:
            raise ValueError(f"{name} must be on {k.device}, got {t.device}")
    if cache.tail_v.data_ptr() % 16 or cache.tail_v.stride(1) % 8 or cache.tail_v.stride(2) % 8:
        raise ValueError("tail_v rows must be 16-byte aligned (the kernel reads 16-byte vectors)")
    variant = Variant(layout.head_dim, INPUT_DTYPES[k.dtype])
    if batch.batch_size == 0 or batch.total_new == 0:
        return StoreCall(variant, None, ())
    v = _aligned(v)
    return StoreCall(variant, _params(layout, batch, k, v, k_buf, v_buf, cache), (k, v))


def _params(layout: PageLayout, batch: PagedBatch, k: Tensor, v: Tensor, k_buf: Tensor, v_buf: Tensor,
            cache: CacheArgs) -> StoreParams:
    cfg, p = layout.config, StoreParams()
    p.k, p.v = k.data_ptr(), v.data_ptr()
    p.k_tok, p.k_head, p.v_tok, p.v_head = k.stride(0), k.stride(1), v.stride(0), v.stride(1)
    p.qo_indptr, p.prefix_lens = batch.qo_indptr.data_ptr(), batch.prefix_lens.data_ptr()
    p.kv_indptr, p.kv_indices = batch.kv_indptr.data_ptr(), batch.kv_indices.data_ptr()
    p.tail_rows, p.sink_slots = batch.tail_rows.data_ptr(), batch.sink_slots.data_ptr()
    p.k_buf, p.v_buf = k_buf.data_ptr(), v_buf.data_ptr()
    p.k_page, p.v_page = k_buf.stride(0), v_buf.stride(0)
    kl, vl = layout.k, layout.v
    p.kc_off, p.km_off, p.ks_off, p.ksum_off = kl.codes.offset, kl.minimum.offset, kl.scale.offset, kl.sums.offset
    p.vc_off, p.vm_off, p.vs_off = vl.codes.offset, vl.minimum.offset, vl.scale.offset
    t, s = cache.tail_k, cache.sink_k
    p.tail_k, p.tail_v = t.data_ptr(), cache.tail_v.data_ptr()
    p.t_row, p.t_tok, p.t_head = t.stride(0), t.stride(1), t.stride(2)
    p.sink_k, p.sink_v = s.data_ptr(), cache.sink_v.data_ptr()
    p.s_slot, p.s_tok, p.s_head = s.stride(0), s.stride(1), s.stride(2)
    p.batch, p.heads, p.max_touched = batch.batch_size, layout.num_heads, batch.max_touched
    p.k_bits, p.v_bits, p.sinks = cfg.bits("k"), cfg.bits("v"), cfg.sink_tokens
    p.meta_bytes = torch.empty(0, dtype=layout.meta_dtype).element_size()
    p.sum_bytes = torch.empty(0, dtype=kl.sums.dtype).element_size()
    p.range_search = int(bool(getattr(cfg, "range_search", False)))
    p.sum_width = reference_sum_width()
    return p


def store_pages(layout: PageLayout, batch: PagedBatch, k: Tensor, v: Tensor, k_buf: Tensor, v_buf: Tensor,
                tail_k: Tensor, tail_v: Tensor | None, sink_k: Tensor | None, sink_v: Tensor | None) -> None:
    """The pages phase on the GPU: every page the new tokens close, and the new sink tokens.
    The tails are read (the tokens of a closing page stored before this call), not written."""
    if k.device.type != "cuda":
        raise ValueError(f"the CUDA store runs on CUDA tensors, got k on {k.device}")
    call = prepare(layout, batch, k, v, k_buf, v_buf, tail_k, tail_v, sink_k, sink_v)
    if call.params is None:
        return
    lib = load(call.variant, device_arch(k.device))
    stream = torch.cuda.current_stream(k.device).cuda_stream
    err = lib.hack_cuda_store(ctypes.byref(call.params), k.device.index or 0, ctypes.c_void_p(stream))
    if err:
        raise RuntimeError(f"the CUDA store kernel failed to launch: {lib.hack_cuda_store_error_string(err).decode()}")


def store(layout: PageLayout, batch: PagedBatch, k: Tensor, v: Tensor, k_buf: Tensor, v_buf: Tensor,
          tail_k: Tensor, tail_v: Tensor | None, sink_k: Tensor | None, sink_v: Tensor | None) -> None:
    """hack_ops.triton.store.store(phase='all') with the pages written by the CUDA kernel: the
    closing pages and sinks first (they read the old tails), then the open page's tokens appended
    to the tails by the Triton store's tail phase."""
    from ..triton.store import store as triton_store

    store_pages(layout, batch, k, v, k_buf, v_buf, tail_k, tail_v, sink_k, sink_v)
    triton_store(layout, batch, k, v, k_buf, v_buf, tail_k, tail_v, sink_k, sink_v, phase="tail")
