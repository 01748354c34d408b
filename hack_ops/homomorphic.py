"""Homomorphic quantized matrix multiplication (the paper's Eq. 1/4), in PyTorch: the one
implementation the dense reference (hack_ops.attention) and the paged torch path
(hack_ops.paged.torch_attention) share, and that the C and Triton kernels are tested against.

With A grouped along its last (inner) dim and B along its first (inner) dim, group g of size G:
    A[i,k] ≈ sa[i,g] * qa[i,k] + ma[i,g],   B[k,j] ≈ sb[g,j] * qb[k,j] + mb[g,j]
    (A @ B)[i,j] ≈ Σ_g  sa sb (qa_g @ qb_g) + sa mb Σ_k qa[i,k] + ma sb Σ_k qb[k,j] + G ma mb
The first term is an integer matmul (INT8 x INT2/INT4 -> INT32); the other three are the
"approximation" and use the code sums (stored, with summation elimination). Nothing is
dequantized. The result equals dequantize(qa) @ dequantize(qb) up to float round-off.

The attention layouts (the project's default, K per channel over a page and V per token):
  scores_channel_k   S = Σ_g sq*(Qq·Kq) + mq*ΣKq + Q·m_K, with Q' = Q ⊙ s_K(page) quantized to
                     INT8 per (query, page, head_dim group): K's per-channel scale folded into Q,
                     ΣKq = K's per-token code sums (stored: summation elimination).
  pv_token_v_codes   Σ_p sp*(Pq·Vq), with P' = P ⊙ s_V(token) quantized to INT8 per (query, page,
                     head_dim group) over [0, max] (P >= 0, so P's minimum and V's code sums vanish).
  pv_token_v_min     Σ_j P_j m_V(j), the min correction (exact, float).
Integer products are computed in float32: |code products| summed over at most 256 elements stay
below 2^24, so they are exact whatever the summation order.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .config import HackConfig
from .quant import QTensor, expand_groups, quantize


def quantize_qp(x: Tensor, dim: int, group: int, cfg: HackConfig, generator: torch.Generator | None,
                zero_min: bool = False, check: bool = True) -> QTensor:
    """The INT8 operand (Q' or P') of Eq. 4: cfg.qp_bits codes, float32 min/scale, the config's
    rounding. zero_min: the range is [0, max] (P >= 0). check=False skips the finiteness scan
    for operands the caller knows to be finite."""
    return quantize(x, cfg.qp_bits, dim=dim, group_size=group, rounding=cfg.rounding, generator=generator,
                    meta_dtype=torch.float32, zero_min=zero_min, check=check)


def scores_channel_k(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_min: Tensor, k_sums: Tensor,
                     cfg: HackConfig, generator: torch.Generator | None, check: bool = True) -> Tensor:
    """Scores of q [..., T, D] (already scaled) against n pages of K quantized per channel over
    each page's Π tokens: k_codes float [..., n, Π, D], k_scale / k_min [..., n, D], k_sums (code
    sums per token and head_dim group) [..., n, Π, ng]. K's leading dims broadcast against q's
    (GQA: a K head may serve several query rows). Returns float32 [..., T, n * Π]."""
    d = q.shape[-1]
    gd = cfg.head_group(d)
    ng = d // gd
    qf = q.unsqueeze(-2) * k_scale.unsqueeze(-3)  # [..., T, n, D]: K's per-channel scale folded into Q
    qq = quantize_qp(qf, -1, gd, cfg, generator, check=check)
    qc = qq.codes.float().reshape(*qf.shape[:-1], ng, gd)
    kc = k_codes.reshape(*k_codes.shape[:-1], ng, gd)
    dot = torch.einsum("...tpgk,...pjgk->...tpjg", qc, kc)  # integers, exact in float32
    s = (qq.scale.unsqueeze(-2) * dot + qq.minimum.unsqueeze(-2) * k_sums.unsqueeze(-4)).sum(-1)
    s = s + torch.einsum("...td,...pd->...tp", q, k_min).unsqueeze(-1)  # Q · min, exact
    return s.reshape(*s.shape[:-2], -1)


def pv_token_v_codes(pw: Tensor, v_codes: Tensor, v_scale: Tensor, cfg: HackConfig,
                     generator: torch.Generator | None, check: bool = True) -> Tensor:
    """The code term of P·V with V quantized per token in head_dim groups: pw [..., T, n * Π]
    (P >= 0, zero where a key is not read), v_codes float [..., n, Π, D], v_scale [..., n * Π, ng].
    Returns float32 [..., T, D]; add pv_token_v_min for the whole product."""
    p = cfg.partition_size
    d = v_codes.shape[-1]
    gd = cfg.head_group(d)
    ng = d // gd
    n = pw.shape[-1] // p
    pf = (pw.unsqueeze(-1) * v_scale.unsqueeze(-3)).reshape(*pw.shape[:-1], n, p, ng)  # V's scale folded into P
    qp = quantize_qp(pf, -2, p, cfg, generator, zero_min=True, check=check)  # per (query, page, group), [0, max]
    vc = v_codes.reshape(*v_codes.shape[:-1], ng, gd)
    dot = torch.einsum("...tpjg,...pjgk->...tpgk", qp.codes.float(), vc)  # integers, exact in float32
    out = (qp.scale.squeeze(-2).unsqueeze(-1) * dot).sum(-3)
    return out.reshape(*out.shape[:-2], d)


def pv_token_v_min(pw: Tensor, v_min: Tensor, group: int) -> Tensor:
    """The min term of P·V with V quantized per token: Σ_j P_j m_V(j), pw [..., T, J] and
    v_min [..., J, ng] -> float32 [..., T, ng * group] (exact float, no quantization)."""
    return expand_groups(torch.einsum("...tj,...jg->...tg", pw, v_min), -1, group)


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
