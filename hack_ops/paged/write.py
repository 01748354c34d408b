"""The PyTorch store step (the reference implementation): quantize new tokens into their pages.

Per new token (position pos, page, offset = pos % Π):
  * pos < sink_tokens: FP16 K and V go to the sequence's sink slot; in the page the token gets
    code 0 and (per-token side) min 0, scale 0, and it takes no part in ranges or sums.
  * a tensor with an FP16 tail (HackConfig.k_tail / v_tail: both by default; always the
    per-channel one): written to the row's tail; a page whose last offset (Π-1) arrives is
    quantized once, whole, over its non-sink tokens (codes, min/scale, K's per-token code
    sums), per channel or per token (head_dim groups of min(Π, D)) as the orientation says,
    and its tail is done with (requantization elimination).
  * a per-token tensor without a tail: quantized at once into its page slot.
  * requant_elimination=False (ablation): every page the write touches is re-quantized over
    the tokens it holds so far (per-channel tensor); a per-token tensor is quantized as written
    (for it that is the same thing); attention then reads the open page from the page.
All arithmetic goes through hack_ops.quant.quantize, so codes and side tables are bit-identical
to the dense reference's for the same input values. The functions take the store's buffers
(`KVBuffers`) and never import the store: HackKVStore.write owns the input checks and picks
this reference, the tail append or the compiled store (cpu_store.py).
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ..config import HackConfig, OpenMode
from ..layout import PageLayout, TensorLayout
from ..packing import pack
from ..quant import group_code_sums, quantize
from .plan import ForwardPlan


class KVBuffers(Protocol):
    """What the store step writes: HackKVStore's buffers (see store.py)."""

    config: HackConfig
    device: torch.device
    k_pages: list[Tensor]
    v_pages: list[Tensor]
    sink_k: list[Tensor]
    sink_v: list[Tensor]

    @property
    def num_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    def tail(self, name: str, layer: int) -> Tensor | None: ...

    def config_for(self, layer: int) -> HackConfig: ...

    def layout_for(self, layer: int) -> PageLayout: ...


def appends_only(config: HackConfig, plan: ForwardPlan) -> bool:
    """True when every new token of the plan only appends to its row's FP16 tails: both
    tensors keep the open partition in FP16, and no token is a sink or the last of its page."""
    return (config.tails_hold_open and int(plan.tok_pos.min()) >= config.sink_tokens
            and int(plan.tok_off.max()) < config.partition_size - 1)


def append_to_tails(store: KVBuffers, layer: int, plan: ForwardPlan, k: Tensor, v: Tensor) -> None:
    """The store step of a plan for which `appends_only` holds: two index writes."""
    rows, offs = plan.tok_row, plan.tok_off
    store.tail("k", layer)[rows, offs] = k.to(torch.float16)
    store.tail("v", layer)[rows, offs] = v.to(torch.float16)


def write_tokens(store: KVBuffers, layer: int, plan: ForwardPlan, k: Tensor, v: Tensor,
                 generator: torch.Generator | None = None) -> None:
    """The reference store step for checked k, v [N, H, D] (any configuration)."""
    cfg, lay = store.config_for(layer), store.layout_for(layer)
    dev = store.device
    s = cfg.sink_tokens
    pos = plan.tok_pos.to(dev)
    is_sink = pos < s
    if s and bool(is_sink.any()):
        slots = plan.sink_slot.to(dev)[plan.tok_req.to(dev)[is_sink]]
        store.sink_k[layer][slots, pos[is_sink]] = k.to(dev)[is_sink].to(torch.float16)
        store.sink_v[layer][slots, pos[is_sink]] = v.to(dev)[is_sink].to(torch.float16)
    for name, x in (("k", k), ("v", v)):
        tl: TensorLayout = getattr(lay, name)
        buf = (store.k_pages if name == "k" else store.v_pages)[layer]
        tail = store.tail(name, layer)
        mode = cfg.open_mode(name)
        if mode == OpenMode.QUANT:  # per-token tensor read quantized as soon as it is written
            _quantize_tokens(store, cfg, tl, buf, plan, x.to(dev), is_sink, name == "k", generator)
        if tail is not None:
            pages = "none" if mode == OpenMode.QUANT else ("all" if mode == OpenMode.REQUANT else "closed")
            _write_tail(store, cfg, tl, buf, tail, plan, x.to(dev), name == "k", pages, generator)


def _quantize_tokens(store, cfg: HackConfig, tl: TensorLayout, buf: Tensor, plan: ForwardPlan, x: Tensor,
                     is_sink: Tensor, is_k: bool, gen) -> None:
    """Per-token quantization of the new tokens straight into their page slots (cfg: the layer's)."""
    p, h, d = cfg.partition_size, store.num_heads, store.head_dim
    gd = cfg.head_group(d)
    ng = d // gd
    n_pages = buf.shape[0]
    mask = (~is_sink)[:, None, None].expand(x.shape)
    qt = quantize(x.float(), tl.bits, dim=-1, group_size=gd, rounding=cfg.rounding, generator=gen,
                  meta_dtype=tl.minimum.dtype, mask=mask, range_search=cfg.range_search)
    scale = qt.scale.masked_fill(is_sink[:, None, None], 0)  # sinks: min 0, scale 0 (layout rule)
    pages = plan.tok_page.to(buf.device)
    offs = plan.tok_off.to(buf.device)
    tl.view(buf, "codes")[pages, :, offs] = pack(qt.codes, tl.bits)
    tl.view(buf, "minimum").view(n_pages, h, p, ng)[pages, :, offs] = qt.minimum
    tl.view(buf, "scale").view(n_pages, h, p, ng)[pages, :, offs] = scale
    if is_k:  # per-token sums over each head_dim group (summation elimination)
        sums = tl.view(buf, "sums")
        sums.view(n_pages, h, p, ng)[pages, :, offs] = qt.sums.to(sums.dtype)


def _write_tail(store, cfg: HackConfig, tl: TensorLayout, buf: Tensor, tail: Tensor, plan: ForwardPlan, x: Tensor,
                is_k: bool, pages_to_quantize: str, gen) -> None:
    """FP16 tail of the open page; pages are quantized whole when they close ('closed'), at
    every write ('all': RQE ablation), or not at all ('none': the tokens were quantized already)."""
    p = cfg.partition_size
    dev = buf.device
    x16 = x.to(torch.float16)
    pages = plan.tok_page.to(dev)
    offs = plan.tok_off.to(dev)
    rows = plan.tok_row.to(dev)
    pos = plan.tok_pos.to(dev)
    upages, inv = torch.unique(pages, return_inverse=True)
    nu = upages.shape[0]
    fill = torch.zeros(nu, dtype=torch.long, device=dev).scatter_reduce_(0, inv, offs + 1, "amax")
    closes = fill == p
    if pages_to_quantize != "none":
        quant = closes if pages_to_quantize == "closed" else torch.ones_like(closes)
        if bool(quant.any()):
            row_u = torch.zeros(nu, dtype=torch.long, device=dev).scatter_(0, inv, rows)
            first_u = torch.zeros(nu, dtype=torch.bool, device=dev).scatter_(0, inv, pos < p)
            sel = torch.nonzero(quant).flatten()
            # The page's FP16 content: what earlier writes left in the tail, overlaid with this one.
            content = tail[row_u[sel]].float()  # [C, Π, H, D]
            where = torch.full((nu,), -1, dtype=torch.long, device=dev)
            where[sel] = torch.arange(sel.shape[0], device=dev)
            mine = where[inv] >= 0
            content[where[inv[mine]], offs[mine]] = x16[mine].float()
            j = torch.arange(p, device=dev)
            valid = (j[None, :] < fill[sel][:, None]) & ~(first_u[sel][:, None] & (j[None, :] < cfg.sink_tokens))
            quantize_pages(store, cfg, tl, buf, upages[sel], content, valid, is_k, gen)
    if pages_to_quantize == "none":
        keep = torch.ones_like(pages, dtype=torch.bool)
    else:
        keep = ~closes[inv]  # tokens of pages still open stay in the tail
    if bool(keep.any()):
        tail[rows[keep], offs[keep]] = x16[keep]


def quantize_pages(store, cfg: HackConfig, tl: TensorLayout, buf: Tensor, tpages: Tensor, content: Tensor,
                   valid: Tensor, is_k: bool, gen) -> None:
    """Quantize whole pages (content [C, Π, H, D], valid [C, Π]) into buf at page ids tpages,
    with the layer's config cfg."""
    p, h, d = cfg.partition_size, store.num_heads, store.head_dim
    gd = cfg.head_group(d)
    ng = d // gd
    c = content.shape[0]
    mask = valid[:, :, None, None].expand(content.shape)
    meta = tl.minimum.dtype
    if tl.per_channel:
        qt = quantize(content, tl.bits, dim=1, group_size=p, rounding=cfg.rounding, generator=gen,
                      meta_dtype=meta, mask=mask, range_search=cfg.range_search)
        mn, sc = qt.minimum[:, 0], qt.scale[:, 0]  # [C, H, D]
    else:
        qt = quantize(content, tl.bits, dim=-1, group_size=gd, rounding=cfg.rounding, generator=gen,
                      meta_dtype=meta, mask=mask, range_search=cfg.range_search)
        sc = qt.scale.masked_fill(~valid[:, :, None, None], 0)  # sinks: min 0, scale 0
        mn = qt.minimum.transpose(1, 2).reshape(c, h, p * ng)
        sc = sc.transpose(1, 2).reshape(c, h, p * ng)
    codes = qt.codes.transpose(1, 2)  # [C, H, Π, D] head-major like the page
    tl.view(buf, "codes")[tpages] = pack(codes.contiguous(), tl.bits)
    tl.view(buf, "minimum")[tpages] = mn
    tl.view(buf, "scale")[tpages] = sc
    if is_k:  # per-token sums over each head_dim group
        sums = tl.view(buf, "sums")
        ks = group_code_sums(codes, tl.bits, gd)  # [C, H, Π, ng]
        sums[tpages] = ks.reshape(c, h, p * ng).to(sums.dtype)
