"""The CUDA decode kernel's arithmetic replayed on the CPU in PyTorch, to state its accuracy
without a GPU: the same pages, the same fp16 roundings, fp32 everywhere else.

What the kernel rounds (csrc/hack_decode.cu): q·scale to fp16 (its head; the residual joins the
Q·m_K and FP16-key products, which are therefore ~fp32), Q' = fp16(q_hi ⊙ s_K) per page, the
softmax numerators to fp16 before P' = fp16(p ⊙ s_V) per (token, group) and before the FP16
values' product. Codes are exact in fp16; products accumulate in fp32. The order of the fp32
sums and the online softmax's running maximum differ from this replay by fp32 round-off.

tests/test_cuda_emulate.py holds this replay to hack_ops.attention: within
hack_ops.cuda.decode.TOL_* of mode 'dequant' (the same pages, float attention), and no farther
from exact attention than mode 'hack' (INT8 Q' and P', what the CPU and Triton paths compute).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..layout import PageLayout
from ..paged.pages import request_pages


def _f16(x: Tensor) -> Tensor:
    return x.half().float()


def emulate_request(layout: PageLayout, bufs: dict[str, Tensor], pages: list[int], seq_len: int, q: Tensor,
                    tail_row: int, sink_slot: int, scale: float | None = None, window: int | None = None,
                    logit_cap: float = 0.0) -> Tensor:
    """One request's decode output [Hq, D] (float32) as the kernel computes it: q [Hq, D] is the
    query at position seq_len - 1; bufs holds one layer's pages, tails and sinks (new_buffers)."""
    cfg = layout.config
    p, h, d = layout.page_size, layout.num_heads, layout.head_dim
    gd = cfg.head_group(d)
    hq = q.shape[0]
    rep = hq // h
    s_tok = cfg.sink_tokens
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    n_closed, r = divmod(seq_len, p)
    lo = 0 if window is None else max(seq_len - 1 - window, 0)
    pg_from = max(lo, s_tok)
    qs = q.float() * scale
    q_hi = _f16(qs)
    out = torch.empty(hq, d)
    rp = request_pages(layout, bufs["k_buf"], bufs["v_buf"], torch.tensor(pages[:n_closed])) if n_closed else None
    for kv in range(h):
        rows = slice(kv * rep, (kv + 1) * rep)
        scores, kinds = [], []
        if rp is not None:
            kp, vp = rp.k, rp.v
            q_prime = _f16(q_hi[rows][None] * kp.scale[kv][:, None, :])  # [n, rep, D]
            s = torch.einsum("nrd,njd->rnj", q_prime, kp.codes[kv]) + torch.einsum("rd,nd->rn", qs[rows], kp.minimum[kv])[..., None]
            pos = torch.arange(n_closed * p).reshape(n_closed, p)
            scores.append(s.masked_fill(pos[None] < pg_from, float("-inf")).reshape(rep, -1))
        if r:
            tk = bufs["tail_k"][tail_row, :r, kv].float()
            s = qs[rows] @ tk.T
            scores.append(s.masked_fill((n_closed * p + torch.arange(r))[None] < pg_from, float("-inf")))
        ns = min(s_tok, seq_len)
        if ns:
            sk = bufs["sink_k"][sink_slot, :ns, kv].float()
            scores.append((qs[rows] @ sk.T).masked_fill(torch.arange(ns)[None] < lo, float("-inf")))
        s = torch.cat(scores, -1)
        if logit_cap:
            s = logit_cap * torch.tanh(s / logit_cap)
        prob = torch.exp(s - s.amax(-1, keepdim=True))
        acc = torch.zeros(rep, d)
        at = 0
        if rp is not None:
            n = n_closed * p
            pp = prob[:, :n].reshape(rep, n_closed, p)
            vs, vm = rp.v.scale[kv], rp.v.minimum[kv]  # [n, Π, ng]
            p16 = _f16(pp)
            for g in range(d // gd):
                ch = slice(g * gd, (g + 1) * gd)
                p_prime = _f16(p16 * vs[None, :, :, g])
                acc[:, ch] += torch.einsum("rnj,njd->rd", p_prime, rp.v.codes[kv][:, :, ch])
                acc[:, ch] += (pp * vm[None, :, :, g]).sum((1, 2))[:, None]
            at = n
        if r:
            acc += _f16(prob[:, at:at + r]) @ bufs["tail_v"][tail_row, :r, kv].float()
            at += r
        if ns:
            acc += _f16(prob[:, at:at + ns]) @ bufs["sink_v"][sink_slot, :ns, kv].float()
        out[rows] = acc / prob.sum(-1, keepdim=True)
    return out
