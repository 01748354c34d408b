"""What the CUDA decode kernel covers, and the reason a layer or a device takes the Triton path.

The kernel reads layout-v2 pages of the serving default: Π = 64, 2-bit K and V codes, fp16 side
tables, K per channel over the page with FP16 tails for K and V, requantization elimination on;
head_dim 64, 128 or 256; at most 8 query heads per KV head (the MMA's N); bf16 or fp16 queries.
Sinks, the open partition's FP16 tail, sliding windows and logit soft-capping are all handled.
Everything else runs on hack_ops.triton (4-bit layers among them: a server picks per layer).
"""
from __future__ import annotations

from enum import StrEnum

import torch

from ..layout import PageLayout
from .build import MIN_ARCH, ActDtype, Variant, nvcc
from .fragment import HEAD_DIMS, PAGE, CodeOrder

MAX_REP = 8  # query heads per KV head: the N of mma.m16n8k16


class DecodeKernel(StrEnum):
    """The GPU decode attention a server runs (engine.gpu_attention chooses at startup)."""

    CUDA = "cuda"  # hack_ops.cuda: fp16 MMA on codes widened in registers
    TRITON = "triton"  # hack_ops.triton: the portable path (any GPU Triton runs on; the interpreter)


ACT_DTYPES = {torch.bfloat16: ActDtype.BF16, torch.float16: ActDtype.FP16}


def layout_why_not(layout: PageLayout, num_qo_heads: int) -> str | None:
    """None when the kernel reads this layer's pages, else the reason it does not."""
    cfg = layout.config
    checks = (
        (cfg.orientation == "channel_k", f"orientation {cfg.orientation!r} (the kernel reads 'channel_k')"),
        (cfg.requant_elimination, "requant_elimination=False"),
        (layout.page_size == PAGE, f"page size {layout.page_size} (the kernel reads Π = {PAGE})"),
        (cfg.bits("k") == 2 and cfg.bits("v") == 2, f"{cfg.bits('k')}-bit K / {cfg.bits('v')}-bit V codes "
                                                     "(the kernel widens 2-bit codes)"),
        (cfg.meta_dtype == "float16", f"meta_dtype {cfg.meta_dtype!r} (the kernel reads fp16 side tables)"),
        (cfg.v_tail and cfg.k_tail, f"tail_tensors {cfg.tail_tensors!r} (the kernel reads FP16 tails for K and V)"),
        (layout.head_dim in HEAD_DIMS, f"head_dim {layout.head_dim} (the kernel covers {HEAD_DIMS})"),
        (layout.version == 2 and layout.v.sums is None, f"page layout version {layout.version}"),
        (not cfg.k_outlier_channels, "k_outlier_channels (reference only)"),
        (num_qo_heads > 0 and num_qo_heads % layout.num_heads == 0,
         f"{num_qo_heads} query heads on {layout.num_heads} KV heads"),
    )
    for ok, why in checks:
        if not ok:
            return why
    rep = num_qo_heads // layout.num_heads
    if rep > MAX_REP:
        return f"{rep} query heads per KV head (the kernel's MMA holds {MAX_REP})"
    return None


def device_why_not(device: torch.device | str | None = None) -> str | None:
    """None when the kernel can be built and run on `device`, else the reason."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return f"device {dev} is not a CUDA device"
    major, minor = torch.cuda.get_device_capability(dev)
    if 10 * major + minor < MIN_ARCH:
        return f"compute capability {major}.{minor} (the kernel needs {MIN_ARCH // 10}.0+: mma.sync, cp.async)"
    if nvcc() is None:
        return "nvcc not found (the kernel is compiled on the machine it runs on)"
    return None


def variant_for(layout: PageLayout, q_dtype: torch.dtype, logit_cap: float = 0.0,
                order: CodeOrder = CodeOrder.TOKEN, stages: int = 2) -> Variant:
    """The library variant that serves a layer: its head_dim, the activation dtype, the pages'
    code order, whether the layer soft-caps, and the ring depth."""
    if q_dtype not in ACT_DTYPES:
        raise ValueError(f"the CUDA decode kernel takes bf16 or fp16 queries, got {q_dtype}")
    return Variant(layout.head_dim, ACT_DTYPES[q_dtype], CodeOrder(order), logit_cap > 0, stages)
