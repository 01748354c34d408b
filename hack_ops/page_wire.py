"""A HACK page on the wire: which bytes of a page carry information, and how a receiver rebuilds
the rest bit-identically (the `hack-pages` transfer transform, disagg.hack_wire).

A page (hack_ops.layout) holds, per tensor, codes | minimum | scale [| sums]. The K code sums
are derived data: each is the sum of a head_dim group of the same page's codes
(quant.group_code_sums, the store's own definition), so a receiver that has the codes can
recompute them exactly (integer sums, no rounding). The wire form of a page is therefore its
prefix up to the end of the scale section; the sums section (and the alignment padding after
the scale section) need not be sent. A run of pages contiguous on both sides travels as one
block, so only its last page is cut to the wire form: the other pages' sums ride along (one
transfer per run costs less than the bytes saved by one per page). The receiver rebuilds every
received page's sums with `rebuild_derived`; the padding is never written by the store, so it is
zero on both sides.

The open partition's page (the last, partially filled page of a sequence) carries nothing a
receiver reads when both K and V keep the open partition in FP16 tails (HackConfig.
tails_hold_open: the page is quantized whole, on the receiver, when it fills); `open_page_unread`
says when it may be left out.
"""
from __future__ import annotations

import enum
from typing import Sequence

import torch
from torch import Tensor

from .config import HackConfig
from .layout import PageLayout, TensorLayout, page_layout
from .packing import unpack
from .quant import group_code_sums


class PageTensor(enum.Enum):
    K = "k"
    V = "v"


def wire_bytes(tl: TensorLayout) -> int:
    """Bytes of one page of this tensor that travel: codes, minimum and scale."""
    return tl.scale.offset + tl.scale.nbytes


def derived_bytes(tl: TensorLayout) -> int:
    """Bytes of one page of this tensor a receiver rebuilds or never needs (sums, padding)."""
    return tl.page_bytes - wire_bytes(tl)


def tensor_layout(layout: PageLayout, tensor: PageTensor) -> TensorLayout:
    return layout.k if tensor is PageTensor.K else layout.v


def page_code_sums(layout: PageLayout, tensor: PageTensor, buf: Tensor, pages: Tensor) -> Tensor:
    """The code sums of `pages` of a [num_pages, page_bytes] uint8 buffer, computed from their
    codes: [n, H, Π*ng] in the sums section's dtype."""
    tl = tensor_layout(layout, tensor)
    if tl.sums is None:
        raise ValueError(f"tensor {tensor.value} has no sums section")
    cfg = layout.config
    d = layout.head_dim
    gd = cfg.head_group(d)
    codes = unpack(tl.view(buf, "codes")[pages], tl.bits, d)  # [n, H, Π, D]
    sums = group_code_sums(codes, tl.bits, gd)  # [n, H, Π, ng]
    return sums.reshape(pages.shape[0], layout.num_heads, -1).to(tl.sums.dtype)


def rebuild_derived(layout: PageLayout, k_buf: Tensor, pages: Sequence[int] | Tensor) -> None:
    """Recompute the K code sums of `pages` in place from the codes they hold (the receiver's
    half of the transform; V pages have nothing derived)."""
    idx = torch.as_tensor(pages, dtype=torch.long, device=k_buf.device).reshape(-1)
    if idx.numel() == 0:
        return
    tl = layout.k
    tl.view(k_buf, "sums")[idx] = page_code_sums(layout, PageTensor.K, k_buf, idx)


def open_page_unread(config: HackConfig) -> bool:
    """True when a receiver reads nothing of a sequence's open (partial) page: K and V both
    hold the open partition in FP16 tails, so the page is written whole when it fills."""
    return config.tails_hold_open


def wire_page_bytes(layout: PageLayout) -> int:
    """Bytes of one page (K and V of one layer) that travel."""
    return wire_bytes(layout.k) + wire_bytes(layout.v)


def request_bytes(layout: PageLayout, num_layers: int, tokens: int, hack_pages: bool = True) -> int:
    """KV bytes a request of `tokens` tokens puts on the wire: its pages (with hack_pages, in
    one contiguous run without the unread open page, the run's last page in its wire form, as
    disagg.hack_wire sends a run; else every page as stored), the live FP16 tail slots of each
    tensor with a tail, and its FP16 sinks (disagg.pd_state), all layers. A request whose pages
    are split into several runs sends each run's last page in its wire form."""
    p = layout.page_size
    if hack_pages:  # every closed page kept: one run
        return num_layers * kept_request_bytes(layout, tokens, [True] * (tokens // p))
    return num_layers * (-(-tokens // p) * layout.page_bytes + _state_bytes(layout, tokens))


def _state_bytes(layout: PageLayout, tokens: int) -> int:
    """The FP16 bytes a request sends beside its pages, one layer: the live tail slots of each
    tensor with a tail and the sinks (disagg.pd_state)."""
    fp16_token = layout.num_heads * layout.head_dim * 2
    tails = (tokens % layout.page_size) * len(layout.tail_tensors) * fp16_token
    return tails + 2 * layout.config.sink_tokens * fp16_token


def kept_request_bytes(layout: PageLayout, tokens: int, kept: Sequence[bool] | Tensor) -> int:
    """request_bytes (hack_pages, one layer) for a request whose closed pages travel only where
    `kept` [tokens // page_size] is True (static eviction, hack_ops.static_keep): each run of
    consecutive kept pages is one block with its last page in wire form; the open page (when a
    receiver reads it), the tails and the sinks travel as before. All kept: request_bytes."""
    p = layout.page_size
    flags = [bool(x) for x in (kept.tolist() if isinstance(kept, Tensor) else kept)]
    if len(flags) != tokens // p:
        raise ValueError(f"kept names {len(flags)} closed pages; a request of {tokens} tokens has {tokens // p}")
    if not open_page_unread(layout.config) and tokens % p:
        flags.append(True)  # the open page travels, as the last page of the run before it
    runs = sum(1 for i, f in enumerate(flags) if f and (i + 1 == len(flags) or not flags[i + 1]))
    page_bytes = sum(flags) * layout.page_bytes - runs * (derived_bytes(layout.k) + derived_bytes(layout.v))
    return page_bytes + _state_bytes(layout, tokens)


def model_request_bytes(config: HackConfig, num_layers: int, num_heads: int, head_dim: int, tokens: int,
                        hack_pages: bool = True) -> int:
    """request_bytes summed over a model's layers, each in its own format (HackConfig.for_layer:
    a per-layer config puts 4-bit pages in some layers and 2-bit pages in the rest)."""
    return sum(request_bytes(page_layout(config.for_layer(i, num_layers), num_heads, head_dim), 1, tokens,
                             hack_pages=hack_pages) for i in range(num_layers))


def model_kept_request_bytes(config: HackConfig, num_layers: int, num_heads: int, head_dim: int, tokens: int,
                             kept: dict[int, Tensor]) -> int:
    """model_request_bytes (hack_pages) under static eviction: layer i sends the closed pages
    kept[i] [heads, tokens // page_size] keeps for any of its heads (a page holds every KV head
    of its layer, so it travels if one head keeps it); a layer not in `kept` sends every page."""
    total = 0
    for i in range(num_layers):
        lay = page_layout(config.for_layer(i, num_layers), num_heads, head_dim)
        total += (kept_request_bytes(lay, tokens, kept[i].any(0)) if i in kept
                  else request_bytes(lay, 1, tokens))
    return total
