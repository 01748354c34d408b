"""What the Triton kernels support, and the constants/arguments they take from a PageLayout."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import PageLayout

K_SECTIONS = ("codes", "minimum", "scale", "sums")
V_SECTIONS = ("codes", "minimum", "scale")  # layout v2: V has no sums (P has a zero minimum)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class KernelSpec:
    """Compile-time constants of one layer's kernels."""

    heads: int  # KV heads
    page: int  # Π
    head_dim: int  # D
    group: int  # Gd = min(Π, D)
    ngroups: int  # D / Gd
    k_bits: int  # bits per K code
    v_bits: int  # bits per V code (K and V may differ: HackConfig.bits)
    sinks: int
    meta_f16: bool
    v_tail: bool  # V's open partition is FP16 too (tail_tensors='kv'), else V is quantized as written
    range_search: bool  # pages pick each group's clipped range by least squared error

    @property
    def sink_block(self) -> int:
        """Columns of the sink tile (tl.dot needs >= 16, tl.arange a power of two)."""
        return max(16, triton_next_pow2(self.sinks))


def triton_next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def kernel_spec(layout: PageLayout) -> KernelSpec:
    """Constants for `layout`; a clear error for formats the Triton kernels do not implement."""
    cfg = layout.config
    if cfg.orientation != "channel_k":
        raise NotImplementedError(
            "the Triton kernels implement orientation='channel_k' (the default); "
            f"'{cfg.orientation}' runs on the CPU path")
    if not cfg.requant_elimination:
        raise NotImplementedError("the Triton kernels need requant_elimination=True (the RQE ablation is CPU-only)")
    if cfg.rounding != "nearest":
        raise NotImplementedError("the Triton kernels round to nearest; stochastic rounding is CPU-only")
    d, p = layout.head_dim, layout.page_size
    if not (_pow2(d) and _pow2(p) and d >= 32 and p >= 32):
        # INT8 tl.dot needs an inner dimension >= 32 (Gd for Q·K, Π for P·V); tl.arange powers of two.
        raise NotImplementedError(f"the Triton kernels need power-of-two head_dim and page size >= 32, got "
                                  f"D={d}, Π={p}; the CPU path handles the others")
    if layout.version != 2 or layout.v.sums is not None:
        raise NotImplementedError(f"the Triton kernels read page layout version 2, got {layout.version}")
    gd = cfg.head_group(d)
    return KernelSpec(layout.num_heads, p, d, gd, d // gd, cfg.bits("k"), cfg.bits("v"), cfg.sink_tokens,
                      cfg.meta_dtype == "float16", cfg.v_tail, bool(getattr(cfg, "range_search", False)))


def page_sections(layout: PageLayout, k_buf: torch.Tensor, v_buf: torch.Tensor) -> tuple[list, list]:
    """Typed views of the 7 page sections (K: codes, minimum, scale, sums; V: codes, minimum,
    scale; codes as int32 words) and their page strides in elements, in the kernels' order."""
    for name, buf, tl_ in (("k_buf", k_buf, layout.k), ("v_buf", v_buf, layout.v)):
        if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != tl_.page_bytes:
            raise ValueError(f"{name} must be uint8 [num_pages, {tl_.page_bytes}], got "
                             f"{buf.dtype} {tuple(buf.shape)}")
        if buf.stride(1) != 1 or buf.stride(0) % 16:
            raise ValueError(f"{name} rows must be contiguous and 16-byte aligned")
    views = [layout.k.view(k_buf, s) for s in K_SECTIONS] + [layout.v.view(v_buf, s) for s in V_SECTIONS]
    for i in (0, 4):  # codes as little-endian int32 words: one load per 32 // bits codes (each tensor's bits)
        views[i] = views[i].view(torch.int32)
    return views, [t.stride(0) for t in views]


def check_fp16(name: str, t: torch.Tensor, shape_tail: tuple[int, ...]) -> None:
    if t.dtype != torch.float16 or t.dim() != 1 + len(shape_tail) or tuple(t.shape[1:]) != shape_tail:
        raise ValueError(f"{name} must be float16 [N, {', '.join(map(str, shape_tail))}], got "
                         f"{t.dtype} {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along head_dim")


def int8_mma_supported(device: torch.device) -> bool:
    """Whether Triton lowers an INT8 tl.dot to tensor-core MMA on this device (sm80+).
    Older GPUs (V100 sm70, T4 sm75) take the exact fp16-MMA fallback (jit_math.int_dot)."""
    if device.type != "cuda":
        return True  # the interpreter computes integer dots exactly
    return torch.cuda.get_device_capability(device) >= (8, 0)


@dataclass
class CacheArgs:
    """Checked cache tensors of one layer, as the kernels take them."""

    views: list  # 7 typed section views (see page_sections)
    strides: list  # their page strides, in elements
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor

    def args(self) -> list:
        t, sk = self.tail_k, self.sink_k
        return [*self.views, *self.strides, t, self.tail_v, t.stride(0), t.stride(1), t.stride(2),
                sk, self.sink_v, sk.stride(0), sk.stride(1), sk.stride(2)]


def cache_args(layout: PageLayout, k_buf: torch.Tensor, v_buf: torch.Tensor, tail_k: torch.Tensor,
               tail_v: torch.Tensor | None, sink_k: torch.Tensor | None, sink_v: torch.Tensor | None) -> CacheArgs:
    """Check the page buffers ([num_pages, page_bytes] uint8 for K and V), the FP16 tails
    [rows, Π, H, D] (tail_v only when V has a tail) and the FP16 sinks [slots, S, H, D]."""
    views, strides = page_sections(layout, k_buf, v_buf)
    check_fp16("tail_k", tail_k, layout.tail_shape())
    if layout.config.v_tail:
        if tail_v is None:
            raise ValueError("this format keeps V's open partition in FP16: pass tail_v")
        check_fp16("tail_v", tail_v, layout.tail_shape())
        if tail_v.stride() != tail_k.stride():
            raise ValueError("tail_k and tail_v must have the same strides")
    else:  # unused by the kernels; any fp16 tensor keeps one signature
        tail_v = tail_k
    if layout.config.sink_tokens:
        if sink_k is None or sink_v is None:
            raise ValueError("this format has sink tokens: pass sink_k and sink_v")
        check_fp16("sink_k", sink_k, layout.sink_shape())
        check_fp16("sink_v", sink_v, layout.sink_shape())
        if sink_k.stride() != sink_v.stride():
            raise ValueError("sink_k and sink_v must have the same strides")
    else:
        sink_k = sink_v = tail_k
    return CacheArgs(views, strides, tail_k, tail_v, sink_k, sink_v)
