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


def dequant_decode(store, layer: int, plan: ForwardPlan, q: Tensor, scale: float,
                   dtype: torch.dtype = torch.bfloat16, window: int | None = None,
                   logit_cap: float = 0.0) -> Tensor:
    """Decode attention over dequantized pages; returns float32 [B, Hq, D]. With a sliding
    window only the pages from the window's first one are dequantized, and earlier keys of
    that page are masked; logit_cap soft-caps the scores (then attention is computed densely)."""
    cfg, lay = store.config, store.layout
    p, d, h = cfg.partition_size, store.head_dim, store.num_heads
    gd = cfg.head_group(d)
    b_sz, hq, _ = q.shape
    out = torch.empty(b_sz, hq, d, dtype=torch.float32)
    for b, seq_len in enumerate(plan.seq_list):
        npg = int(plan.num_pages[b])
        pages = plan.page_table[b, :npg].to(store.device)
        row = int(plan.rows[b])
        nc = seq_len // p  # closed pages
        first = 0 if window is None else max(0, seq_len - 1 - window)  # first visible key
        lo = first // p  # pages before it are not dequantized
        dense = {}
        with clock.phase("dequantization"):  # the dense copy only, not the SDPA
            for name, tl, buf in (("k", lay.k, store.k_pages[layer]), ("v", lay.v, store.v_pages[layer])):
                quant_open = cfg.open_mode(name) != OpenMode.FP16
                n_q = npg if quant_open else nc  # pages read from their codes
                x = torch.empty(h, npg * p, d, dtype=dtype)
                if n_q > lo:
                    x[:, lo * p: n_q * p] = _dequant_tensor(tl, buf, pages[lo:n_q], p, d, cfg.kv_bits, gd, dtype)
                if not quant_open and seq_len > nc * p:  # the open page from the FP16 tail
                    x[:, nc * p:seq_len] = store.tails[name][layer][row, : seq_len - nc * p].transpose(0, 1).to(dtype)
                s = min(cfg.sink_tokens, seq_len)
                if s > first:
                    sink = (store.sink_k if name == "k" else store.sink_v)[layer][int(plan.sink_slot[b]), first:s]
                    x[:, first:s] = sink.transpose(0, 1).to(dtype)
                dense[name] = x[:, first:seq_len]
        qb = (q[b].to(dtype)).reshape(1, hq, 1, d)
        if logit_cap:
            kk, vv = (dense[n].repeat_interleave(hq // h, 0).float() for n in ("k", "v"))
            sc = (qb[0, :, 0].float() * scale)[:, None, :] @ kk.transpose(-1, -2)  # [Hq, 1, n]
            o = torch.softmax(logit_cap * torch.tanh(sc / logit_cap), -1) @ vv
        else:
            o = F.scaled_dot_product_attention(qb, dense["k"][None], dense["v"][None], scale=scale, enable_gqa=hq != h)
        out[b] = o.reshape(hq, d).float()
    return out


def prefix_dense(store, layer: int, plan: ForwardPlan, b: int, snaps: dict[str, list[Tensor]],
                 dtype: torch.dtype) -> dict[str, Tensor]:
    """Request b's cached prefix as the strawman reads it, dense [H, prefix, D] in dtype: closed
    pages dequantized from their codes, the prefix's open page from the FP16 tokens kept before
    this step's write (`snaps`, tensors with a tail) or from its codes (tensors without one),
    sinks in FP16. Called after the write, which may have closed the prefix's open page."""
    cfg, lay = store.config, store.layout
    p, d, h = cfg.partition_size, store.head_dim, store.num_heads
    gd = cfg.head_group(d)
    pre = plan.prefix_list[b]
    pages = plan.page_table[b, : -(-pre // p)].to(store.device)
    nc = pre // p
    out = {}
    for name, tl, buf in (("k", lay.k, store.k_pages[layer]), ("v", lay.v, store.v_pages[layer])):
        from_tail = name in snaps
        n_q = nc if from_tail else len(pages)  # pages read from their codes
        x = torch.empty(h, max(n_q * p, pre), d, dtype=dtype)
        if n_q:
            x[:, : n_q * p] = _dequant_tensor(tl, buf, pages[:n_q], p, d, cfg.kv_bits, gd, dtype)
        if from_tail and pre > nc * p:
            x[:, nc * p: pre] = snaps[name][b].transpose(0, 1).to(dtype)
        s = min(cfg.sink_tokens, pre)
        if s:
            x[:, :s] = (store.sink_k if name == "k" else store.sink_v)[layer][int(plan.sink_slot[b]), :s].transpose(0, 1).to(dtype)
        out[name] = x[:, :pre]
    return out
