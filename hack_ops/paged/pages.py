"""Unpacked views of one request's pages, for the pure-PyTorch attention path.

`request_pages` gathers the pages of one request and unpacks their codes to float (exact small
integers) and side tables to float32, head-major ([H, pages, ...]). It is the portable path
(and the one the tests read against the dense reference); the compiled CPU kernel reads the
packed pages in place instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import HackConfig
from ..layout import PageLayout, TensorLayout
from ..packing import unpack
from ..quant import quantize


@dataclass
class TensorPages:
    """One tensor (K or V) over a request's pages. Per-channel: scale/minimum [H, n, D];
    per-token: [H, n, Π, ng]. sums (K only): [H, n, Π, ng], per token and head_dim group."""

    codes: Tensor  # float [H, n, Π, D]
    scale: Tensor
    minimum: Tensor
    sums: Tensor | None  # float


@dataclass
class RequestPages:
    k: TensorPages
    v: TensorPages


def _gather(tl: TensorLayout, buf: Tensor, name: str, pages: Tensor) -> Tensor:
    """Section `name` of the pages, head-major [H, n, ...]: pages [n] (every head reads the same
    pages) or [H, n] (head h reads pages[h]: a sparse decode's own selection per KV head)."""
    view = tl.view(buf, name)  # [num_pages, H, ...]
    if pages.dim() == 1:
        return view[pages].transpose(0, 1)
    return view[pages, torch.arange(pages.shape[0], device=pages.device)[:, None]]


def _tensor_pages(tl: TensorLayout, buf: Tensor, pages: Tensor, cfg: HackConfig, d: int, is_k: bool) -> TensorPages:
    p = cfg.partition_size
    ng = d // cfg.head_group(d)
    raw = _gather(tl, buf, "codes", pages)  # [H, n, Π, D*b/8]
    h, n = raw.shape[:2]
    codes = unpack(raw, tl.bits, d).float()
    mn = _gather(tl, buf, "minimum", pages).float()
    sc = _gather(tl, buf, "scale", pages).float()
    if not tl.per_channel:
        mn = mn.reshape(h, n, p, ng)
        sc = sc.reshape(h, n, p, ng)
    sums = None
    if is_k:
        sums = _gather(tl, buf, "sums", pages).float().reshape(h, n, p, ng).contiguous()
    return TensorPages(codes.contiguous(), sc.contiguous(), mn.contiguous(), sums)


def request_pages(layout: PageLayout, k_buf: Tensor, v_buf: Tensor, pages: Tensor) -> RequestPages:
    """One request's pages unpacked: pages [n] page ids, or [H, n] where each KV head reads
    its own (sparse decode)."""
    cfg, d = layout.config, layout.head_dim
    return RequestPages(
        k=_tensor_pages(layout.k, k_buf, pages, cfg, d, True),
        v=_tensor_pages(layout.v, v_buf, pages, cfg, d, False),
    )


def quantize_open_page(x: Tensor, count: int, first_page: bool, cfg: HackConfig, is_k: bool,
                       gen: torch.Generator | None = None) -> TensorPages:
    """Per-channel quantization of an open page's first `count` FP16 tokens (x [<=Π, H, D]),
    exactly as the store does it (requantization-elimination ablation). One page: n = 1."""
    p = cfg.partition_size
    h, d = x.shape[1], x.shape[2]
    gd = cfg.head_group(d)
    content = torch.zeros(p, h, d, dtype=torch.float32)
    content[: x.shape[0]] = x.float()
    j = torch.arange(p)
    valid = (j < count) & ~((j < cfg.sink_tokens) & first_page)
    meta = torch.float16 if cfg.meta_dtype == "float16" else torch.float32
    qt = quantize(content, cfg.bits("k" if is_k else "v"), dim=0, group_size=p, rounding=cfg.rounding, generator=gen,
                  meta_dtype=meta, mask=valid[:, None, None].expand(content.shape),
                  range_search=cfg.range_search)
    codes = qt.codes.permute(1, 0, 2).float().unsqueeze(1)  # [H, 1, Π, D]
    sums = codes.reshape(h, 1, p, d // gd, gd).sum(-1) if is_k else None
    return TensorPages(codes, qt.scale.float().permute(1, 0, 2), qt.minimum.float().permute(1, 0, 2), sums)
