"""Python entry point of the Triton store kernel (see store_kernel.py for what it writes)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..layout import PageLayout
from .batch import PagedBatch
from .launch import Launch
from .spec import CacheArgs, KernelSpec, cache_args, kernel_spec
from .store_kernel import hack_store_kernel

PHASES = ("all", "pages", "tail")


def check_tokens(name: str, t: Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(t, Tensor) or not t.is_floating_point() or tuple(t.shape) != shape or t.stride(-1) != 1:
        raise ValueError(f"{name} must be a floating-point tensor {list(shape)}, contiguous along head_dim; got "
                         f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")


def store(
    layout: PageLayout,
    batch: PagedBatch,
    k: Tensor,
    v: Tensor,
    k_buf: Tensor,
    v_buf: Tensor,
    tail_k: Tensor,
    tail_v: Tensor | None,
    sink_k: Tensor | None,
    sink_v: Tensor | None,
    phase: str = "all",
) -> None:
    """Quantize the batch's new tokens (k, v: [new tokens, H, D], rows by batch.qo_indptr)
    into one layer's pages (k_buf/v_buf: uint8 [num_pages, page_bytes]), its FP16 tails
    (tail_k/tail_v: [rows, Π, H, D]; tail_v None when V has no tail) and sinks
    (sink_k/sink_v: [slots, sink_tokens, H, D]; None without sinks).

    phase: 'pages' writes pages and sinks, 'tail' appends to the tails, 'all' both (two
    launches when a request has more than one new token: the flush reads the old tail).
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    spec = kernel_spec(layout)
    shape = (batch.total_new, spec.heads, spec.head_dim)
    check_tokens("k", k, shape)
    check_tokens("v", v, shape)
    cache = cache_args(layout, k_buf, v_buf, tail_k, tail_v, sink_k, sink_v)
    if batch.total_new == 0:
        return
    phases = ("pages", "tail") if phase == "all" and batch.max_new > 1 else (phase,)
    for ph in phases:
        store_launch(spec, batch, k, v, cache, ph)()


def store_launch(spec: KernelSpec, batch: PagedBatch, k: Tensor, v: Tensor, cache: CacheArgs, phase: str) -> Launch:
    """The kernel launch for checked arguments (also what the AOT compiler compiles)."""
    return Launch(
        hack_store_kernel,
        (batch.max_touched, batch.batch_size, spec.heads * spec.ngroups),
        [k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
         batch.qo_indptr, batch.prefix_lens, batch.kv_indptr, batch.kv_indices, batch.tail_rows, batch.sink_slots,
         *cache.args()],
        dict(P=spec.page, D=spec.head_dim, GD=spec.group, NG=spec.ngroups, K_BITS=spec.k_bits, V_BITS=spec.v_bits,
             S=spec.sinks, META_F16=spec.meta_f16, V_TAIL=spec.v_tail, RANGE_SEARCH=spec.range_search,
             WRITE_PAGES=phase in ("all", "pages"), WRITE_TAIL=phase in ("all", "tail")),
        # Bit-exact with hack_ops.quant: no FMA contraction (range search sums c*s + m - x).
        dict(num_warps=8, enable_fp_fusion=False),
    )


def new_buffers(layout: PageLayout, num_pages: int, tail_rows: int, sink_slots: int,
                device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """Zeroed page buffers, FP16 tails and sink buffers for one layer (tests, benchmarks)."""
    s = layout.sink_shape()
    t = layout.tail_shape()
    return {
        "k_buf": torch.zeros(num_pages, layout.k.page_bytes, dtype=torch.uint8, device=device),
        "v_buf": torch.zeros(num_pages, layout.v.page_bytes, dtype=torch.uint8, device=device),
        "tail_k": torch.zeros(tail_rows, *t, dtype=torch.float16, device=device),
        "tail_v": torch.zeros(tail_rows, *t, dtype=torch.float16, device=device) if layout.config.v_tail else None,
        "sink_k": torch.zeros(sink_slots, *s, dtype=torch.float16, device=device),
        "sink_v": torch.zeros(sink_slots, *s, dtype=torch.float16, device=device),
    }


def cache_kwargs(bufs: dict[str, Tensor]) -> dict[str, Tensor]:
    """The cache arguments of store / run calls, from a new_buffers dict."""
    return {n: bufs[n] for n in ("k_buf", "v_buf", "tail_k", "tail_v", "sink_k", "sink_v")}
