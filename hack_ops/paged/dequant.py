"""The 'dequant' baseline on the HACK pages: dequantize what a query may see, then SDPA.

This is the paper's strawman (a 2-bit cache that is dequantized before ordinary attention, as
KIVI/KVQuant-style systems do): the same pages and visibility as 'hack', but each decode step
builds a dense copy of every request's K and V in `dtype` (BF16 for the baseline server and
the benchmark, float32 to compare with the reference) and calls
torch.nn.functional.scaled_dot_product_attention.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import OpenMode
from ..layout import TensorLayout
from ..packing import unpack
from . import clock
from .plan import ForwardPlan


def _dequant_tensor(tl: TensorLayout, buf: Tensor, pages: Tensor, p: int, d: int, bits: int, gd: int,
                    dtype: torch.dtype) -> Tensor:
    """Dequantize whole pages -> [H, n*Π, D] in dtype."""
    codes = unpack(tl.view(buf, "codes")[pages], bits, d).to(dtype)  # [n, H, Π, D]
    n, h = codes.shape[:2]
    sc = tl.view(buf, "scale")[pages].to(dtype)
    mn = tl.view(buf, "minimum")[pages].to(dtype)
    if tl.per_channel:  # [n, H, D]
        x = codes * sc[:, :, None, :] + mn[:, :, None, :]
    else:  # [n, H, Π*ng] per token and head_dim group
        ng = d // gd
        sc = sc.reshape(n, h, p, ng, 1)
        mn = mn.reshape(n, h, p, ng, 1)
        x = (codes.reshape(n, h, p, ng, gd) * sc + mn).reshape(n, h, p, d)
    return x.transpose(0, 1).reshape(h, n * p, d)


def dense_kv(store, layer: int, plan: ForwardPlan, b: int, length: int, open_tokens: dict[str, Tensor],
             dtype: torch.dtype, first: int = 0, names: tuple[str, ...] = ("k", "v")) -> dict[str, Tensor]:
    """Request b's keys and values at positions first..length-1 as a dequantizing system reads
    them, dense [H, length - first, D] in dtype: pages from their codes (none before `first`'s
    page), the open page from `open_tokens[name]` (its FP16 tokens from the page start to
    `length`) for a tensor whose open partition is read in FP16, sinks in FP16. `names`: the
    tensors wanted ('k', 'v')."""
    cfg, lay = store.config_for(layer), store.layout_for(layer)
    p, d, h = cfg.partition_size, store.head_dim, store.num_heads
    gd = cfg.head_group(d)
    npg = -(-length // p)
    pages = plan.page_table[b, :npg].to(store.device)
    nc = length // p  # closed pages
    lo = first // p
    out = {}
    for name, tl, buf in (("k", lay.k, store.k_pages[layer]), ("v", lay.v, store.v_pages[layer])):
        if name not in names:
            continue
        fp16_open = cfg.open_mode(name) == OpenMode.FP16
        n_q = nc if fp16_open else npg  # pages read from their codes
        x = torch.empty(h, npg * p, d, dtype=dtype, device=buf.device)
        if n_q > lo:
            x[:, lo * p: n_q * p] = _dequant_tensor(tl, buf, pages[lo:n_q], p, d, tl.bits, gd, dtype)
        if fp16_open and length > nc * p:
            x[:, nc * p:length] = open_tokens[name][: length - nc * p].transpose(0, 1).to(dtype)
        s = min(cfg.sink_tokens, length)
        if s > first:
            sink = (store.sink_k if name == "k" else store.sink_v)[layer][int(plan.sink_slot[b]), first:s]
            x[:, first:s] = sink.transpose(0, 1).to(dtype)
        out[name] = x[:, first:length]
    return out


def dequant_decode(store, layer: int, plan: ForwardPlan, q: Tensor, scale: float,
                   dtype: torch.dtype = torch.bfloat16, window: int | None = None,
                   logit_cap: float = 0.0) -> Tensor:
    """Decode attention over dequantized pages; returns float32 [B, Hq, D]. With a sliding
    window only the pages from the window's first one are dequantized, and earlier keys of
    that page are masked; logit_cap soft-caps the scores (then attention is computed densely)."""
    d, h = store.head_dim, store.num_heads
    b_sz, hq, _ = q.shape
    out = torch.empty(b_sz, hq, d, dtype=torch.float32)
    for b, seq_len in enumerate(plan.seq_list):
        row = int(plan.rows[b])
        first = 0 if window is None else max(0, seq_len - 1 - window)  # first visible key
        with clock.phase("dequantization"):  # the dense copy only, not the SDPA
            tails = {name: t[layer][row] for name, t in store.tails.items()}
            dense = dense_kv(store, layer, plan, b, seq_len, tails, dtype, first)
        qb = (q[b].to(dtype)).reshape(1, hq, 1, d)
        if logit_cap:
            kk, vv = (dense[n].repeat_interleave(hq // h, 0).float() for n in ("k", "v"))
            sc = (qb[0, :, 0].float() * scale)[:, None, :] @ kk.transpose(-1, -2)  # [Hq, 1, n]
            o = torch.softmax(logit_cap * torch.tanh(sc / logit_cap), -1) @ vv
        else:
            o = F.scaled_dot_product_attention(qb, dense["k"][None], dense["v"][None], scale=scale, enable_gqa=hq != h)
        out[b] = o.reshape(hq, d).float()
    return out
