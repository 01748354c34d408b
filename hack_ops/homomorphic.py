"""Homomorphic quantized matrix multiplication (the paper's Eq. 1/4).

With A grouped along its last (inner) dim and B along its first (inner) dim, group g of size G:
    A[i,k] ≈ sa[i,g] * qa[i,k] + ma[i,g],   B[k,j] ≈ sb[g,j] * qb[k,j] + mb[g,j]
    (A @ B)[i,j] ≈ Σ_g  sa sb (qa_g @ qb_g) + sa mb Σ_k qa[i,k] + ma sb Σ_k qb[k,j] + G ma mb
The first term is an integer matmul (INT8 x INT2/INT4 -> INT32); the other three are the
"approximation" and use the code sums (stored, with summation elimination). Nothing is
dequantized. The result equals dequantize(qa) @ dequantize(qb) up to float round-off.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .quant import QTensor, quantize


def int_matmul_grouped(qa: Tensor, qb: Tensor, group_size: int) -> Tensor:
    """Per-group integer products: qa [..., M, K], qb [..., K, N] -> [..., M, K/G, N] (int64
    exact; float64 holds these sums exactly too, and torch has no int matmul on every device)."""
    m, k = qa.shape[-2:]
    n = qb.shape[-1]
    ng = k // group_size
    a = qa.reshape(*qa.shape[:-1], ng, group_size).to(torch.float64)
    b = qb.reshape(*qb.shape[:-2], ng, group_size, n).to(torch.float64)
    return torch.einsum("...mgk,...gkn->...mgn", a, b)


def homomorphic_matmul_q(qa: QTensor, qb: QTensor, summation_elimination: bool = True) -> Tensor:
    """Eq. 4 on already quantized operands. qa grouped along its last dim, qb along dim -2."""
    g = qa.group_size
    if qb.group_size != g:
        raise ValueError(f"group sizes differ: {qa.group_size} vs {qb.group_size}")
    if qa.dim != qa.codes.dim() - 1 or qb.dim != qb.codes.dim() - 2:
        raise ValueError("qa must be grouped along its last dim and qb along its first matmul dim")
    prod = int_matmul_grouped(qa.codes, qb.codes, g)  # [..., M, ng, N]
    if summation_elimination:
        sa_codes = qa.sums.to(torch.float64)  # [..., M, ng]
        sb_codes = qb.sums.to(torch.float64)  # [..., ng, N]
    else:  # the paper's HACK/SE ablation: recompute the sums from the codes every time
        sa_codes = qa.codes.reshape(*qa.codes.shape[:-1], -1, g).to(torch.float64).sum(-1)
        sb_codes = qb.codes.reshape(*qb.codes.shape[:-2], -1, g, qb.codes.shape[-1]).to(torch.float64).sum(-2)
    sa = qa.scale.double().unsqueeze(-1)  # [..., M, ng, 1]
    ma = qa.minimum.double().unsqueeze(-1)
    sb = qb.scale.double().unsqueeze(-3)  # [..., 1, ng, N]
    mb = qb.minimum.double().unsqueeze(-3)
    out = sa * sb * prod + sa * mb * sa_codes.unsqueeze(-1) + ma * sb * sb_codes.unsqueeze(-3) + g * ma * mb
    return out.sum(-2).float()


def homomorphic_matmul(
    a: Tensor,
    b: Tensor,
    group_size: int,
    a_bits: int = 8,
    b_bits: int = 2,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    summation_elimination: bool = True,
) -> Tensor:
    """C ≈ A @ B from quantized A (groups along its last dim) and B (groups along its first)."""
    if a.dim() < 2 or b.dim() < 2 or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"shapes do not multiply: {tuple(a.shape)} @ {tuple(b.shape)}")
    qa = quantize(a, a_bits, dim=-1, group_size=group_size, rounding=rounding, generator=generator)
    qb = quantize(b, b_bits, dim=-2, group_size=group_size, rounding=rounding, generator=generator)
    return homomorphic_matmul_q(qa, qb, summation_elimination)
