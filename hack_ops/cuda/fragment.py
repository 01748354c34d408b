"""Where the CUDA decode kernel's codes go: a bit-exact model of its MMA fragments, and the
fragment code order of a page.

The kernel (csrc/hack_frag.cuh) computes Sᵀ = K·Q'ᵀ and Oᵀ = Vᵀ·P'ᵀ with mma.m16n8k16 on fp16
operands. Lane = 4g + t of a warp holds registers of 16x16 A tiles (four registers of two fp16
values each: rows g and g + 8, contraction index 2t, 2t+1 and 2t+8, 2t+9). The contraction index
of a dot product may be permuted freely when both operands agree, so the kernel picks the
permutation under which a lane's K codes are whole packed words of one token, and its V codes are
16-bit pieces of two tokens. This module states which (token, channel) every register half holds
(`k_operand`, `v_operand`, `q_channels`, `out_channels`), the two byte orders of a page's codes,
and the conversion between them:

  CodeOrder.TOKEN     layout v2's order, [H, Π, D/4] bytes, codes packed along head_dim: what the
                      pool, the CPU path, the Triton kernels and PD transfers hold.
  CodeOrder.FRAGMENT  per head, the bytes in the order the kernel's lanes read them, 16-byte
                      vectors per lane and tile (`fragment_permutation`); only the CUDA kernel
                      reads it. Same page size, side tables untouched: a permutation of the code
                      bytes inside each (page, head), so converting is one gather (`to_fragment`,
                      `to_token`, `convert_pages`: the one place a page changes order).

Π = 64, 2-bit codes, head_dim 64, 128 or 256 (the kernel's scope, hack_ops.cuda.spec).
"""
from __future__ import annotations

from enum import StrEnum
from functools import lru_cache

import torch
from torch import Tensor

from ..layout import PageLayout

PAGE = 64
HEAD_DIMS = (64, 128, 256)
LANES = 32


class CodeOrder(StrEnum):
    TOKEN = "token"
    FRAGMENT = "fragment"


class PageTensor(StrEnum):
    """Which page tensor a map describes."""

    K = "k"
    V = "v"


def _check(head_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the CUDA kernel's fragment layout covers head_dim {HEAD_DIMS}, got {head_dim}")


def _lanes() -> tuple[Tensor, Tensor]:
    lane = torch.arange(LANES)
    return lane // 4, lane % 4  # g, t


def q_channels(head_dim: int) -> Tensor:
    """[k-tiles, 16]: the channel at contraction index κ of k-tile kk of Sᵀ = K·Q'ᵀ (K's codes,
    K's scale and minimum, Q' and the FP16 tail's K all use it). Lane t holds κ = 2t + h + 8·slot:
    pair P = 2kk + slot of its slice of D/4 channels, channel t·D/4 + 16(P // 8) + P % 8 + 8h
    (low and high halves of one packed word of 16 codes)."""
    _check(head_dim)
    kk = torch.arange(head_dim // 16)[:, None]
    kappa = torch.arange(16)[None, :]
    t, h, slot = (kappa % 8) // 2, kappa % 2, kappa // 8
    p = 2 * kk + slot
    return t * (head_dim // 4) + 16 * (p // 8) + p % 8 + 8 * h


def k_operand(head_dim: int) -> Tensor:
    """[m-tile 4, lane 32, k-tile D/16, register 4, half 2, (token, channel)]: what each fp16 of
    the A fragments of Sᵀ holds. Register r: row g + 8(r % 2), contraction 2t + h + 8(r // 2)."""
    chan = q_channels(head_dim)
    g, t = _lanes()
    mt = torch.arange(4)[:, None, None, None, None]
    kk = torch.arange(head_dim // 16)[None, None, :, None, None]
    r = torch.arange(4)[None, None, None, :, None]
    h = torch.arange(2)[None, None, None, None, :]
    gl, tl = g[None, :, None, None, None], t[None, :, None, None, None]
    token = 16 * mt + gl + 8 * (r % 2)
    kappa = 2 * tl + h + 8 * (r // 2)
    channel = chan[kk, kappa]
    token, channel = torch.broadcast_tensors(token, channel)
    return torch.stack([token, channel], -1)


def out_channel(head_dim: int, md: Tensor, row: Tensor) -> Tensor:
    """The channel of row `row` (0..15) of Oᵀ's m-tile md: 64·(md // 4) + 8·(row % 8) + 2·(md % 4)
    + row // 8. Each m-tile lies in one head_dim group of 64 (V's per-token scale folds into P' per
    group), and lane g holds channels 8g .. 8g + 7 of every group."""
    _check(head_dim)
    return 64 * (md // 4) + 8 * (row % 8) + 2 * (md % 4) + row // 8


def v_operand(head_dim: int) -> Tensor:
    """[k-tile 4, lane 32, m-tile D/16, register 4, half 2, (token, channel)]: what each fp16 of
    the A fragments of Oᵀ = Vᵀ·P'ᵀ holds. Register r: channel row g + 8(r % 2), tokens 2t + h +
    8(r // 2) of the k-tile (the two halves of a register are two tokens, one channel)."""
    _check(head_dim)
    g, t = _lanes()
    kt = torch.arange(4)[:, None, None, None, None]
    md = torch.arange(head_dim // 16)[None, None, :, None, None]
    r = torch.arange(4)[None, None, None, :, None]
    h = torch.arange(2)[None, None, None, None, :]
    gl, tl = g[None, :, None, None, None], t[None, :, None, None, None]
    token = 16 * kt + 2 * tl + h + 8 * (r // 2)
    channel = out_channel(head_dim, md, gl + 8 * (r % 2))
    token, channel = torch.broadcast_tensors(token, channel)
    return torch.stack([token, channel], -1)


def out_channels(head_dim: int) -> Tensor:
    """[m-tile D/16, lane 32, accumulator 4, (channel, query head)] of Oᵀ's C fragments (where the
    kernel writes each output): c_e is row g + 8(e // 2), query head 2t + e % 2."""
    g, t = _lanes()
    md = torch.arange(head_dim // 16)[:, None, None]
    e = torch.arange(4)[None, None, :]
    ch = out_channel(head_dim, md, g[None, :, None] + 8 * (e // 2))
    qh = 2 * t[None, :, None] + e % 2
    ch, qh = torch.broadcast_tensors(ch, qh)
    return torch.stack([ch, qh], -1)


@lru_cache(maxsize=None)
def fragment_permutation(head_dim: int, tensor: PageTensor | str) -> Tensor:
    """Long [Π·D/4]: fragment-order byte i is token-order byte perm[i] of one head's codes.
    K: per (m-tile, lane) KSLICE = D/16 bytes of token 16mt + g, then of token 16mt + g + 8, the
    lane's slice t. V: per (k-tile, lane), for the token pairs (2t, 2t+1) and (2t+8, 2t+9) and each
    group of 64 channels, one word: bytes 2g, 2g+1 of the group of the first token, then the same
    of the second (a word whose pair i is channel 8g + i of both tokens)."""
    _check(head_dim)
    tensor = PageTensor(tensor)
    row = head_dim // 4
    g, t = _lanes()
    if tensor == PageTensor.K:
        ks = head_dim // 16
        mt = torch.arange(4)[:, None, None, None]
        r = torch.arange(2)[None, None, :, None]
        b = torch.arange(ks)[None, None, None, :]
        tok = 16 * mt + g[None, :, None, None] + 8 * r
        idx = tok * row + t[None, :, None, None] * ks + b
    else:
        ng = head_dim // 64
        kt = torch.arange(4)[:, None, None, None, None]
        tp = torch.arange(2)[None, None, :, None, None]
        grp = torch.arange(ng)[None, None, None, :, None]
        q = torch.arange(4)[None, None, None, None, :]
        gl, tl = g[None, :, None, None, None], t[None, :, None, None, None]
        tok = 16 * kt + 2 * tl + 8 * tp + q // 2
        idx = tok * row + 16 * grp + 2 * gl + q % 2
    return idx.reshape(-1).contiguous()


def _permute(codes: Tensor, head_dim: int, tensor: PageTensor | str, inverse: bool) -> Tensor:
    if codes.dtype != torch.uint8 or codes.shape[-2:] != (PAGE, head_dim // 4):
        raise ValueError(f"codes must be uint8 [..., {PAGE}, {head_dim // 4}] (one head's page per matrix), got "
                         f"{codes.dtype} {tuple(codes.shape)}")
    perm = fragment_permutation(head_dim, tensor).to(codes.device)
    flat = codes.reshape(*codes.shape[:-2], -1)
    if inverse:
        out = torch.empty_like(flat)
        out[..., perm] = flat
    else:
        out = flat[..., perm]
    return out.reshape(codes.shape)


def to_fragment(codes: Tensor, head_dim: int, tensor: PageTensor | str) -> Tensor:
    """Token-order code bytes [..., Π, D/4] (a codes section view) -> the same bytes in fragment
    order, same shape (on any device)."""
    return _permute(codes, head_dim, tensor, inverse=False)


def to_token(codes: Tensor, head_dim: int, tensor: PageTensor | str) -> Tensor:
    """The inverse of to_fragment."""
    return _permute(codes, head_dim, tensor, inverse=True)


def convert_pages(layout: PageLayout, k_buf: Tensor, v_buf: Tensor, to: CodeOrder, pages: Tensor | None = None) -> None:
    """Rewrite the code sections of `pages` (default: all) of one layer's buffers into order `to`,
    in place (from the other order). The side tables are the same in both orders."""
    to = CodeOrder(to)
    idx = slice(None) if pages is None else pages.to(k_buf.device).long()
    for name, buf in (("k", k_buf), ("v", v_buf)):
        tl_ = layout.k if name == "k" else layout.v
        view = tl_.view(buf, "codes")
        conv = to_fragment if to == CodeOrder.FRAGMENT else to_token
        view[idx] = conv(view[idx], layout.head_dim, name)


def pack_fragment(codes: Tensor, tensor: PageTensor | str) -> Tensor:
    """One head's 2-bit codes [Π, D] (uint8, token x channel) -> its fragment-order bytes
    [Π, D/4], built from the operand maps alone: for every register half of every lane, the code
    of the (token, channel) the MMA expects there, at the bits the kernel's widening reads (pair i
    of a word: bits 2i of the low and of the high 16 bits). Independent of to_fragment."""
    tensor = PageTensor(tensor)
    p, d = codes.shape
    if codes.dtype != torch.uint8 or p != PAGE:
        raise ValueError(f"codes must be uint8 [{PAGE}, head_dim], got {codes.dtype} {tuple(codes.shape)}")
    words = _fragment_words(d, tensor)  # [n words, 16, (token, channel)]
    vals = codes.long()[words[..., 0], words[..., 1]]  # [n, 16]: code j of each word at bits 2j
    w = (vals << (2 * torch.arange(16))).sum(-1)
    out = torch.stack([(w >> (8 * i)) & 0xFF for i in range(4)], -1).to(torch.uint8)
    return out.reshape(PAGE, d // 4)


def unpack_fragment(packed: Tensor, tensor: PageTensor | str) -> Tensor:
    """The inverse of pack_fragment: fragment-order bytes [Π, D/4] -> codes [Π, D]."""
    tensor = PageTensor(tensor)
    d = packed.shape[-1] * 4
    words = _fragment_words(d, tensor)
    b = packed.reshape(-1, 4).long()
    w = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
    vals = (w[:, None] >> (2 * torch.arange(16))) & 3
    out = torch.zeros(PAGE, d, dtype=torch.uint8)
    out[words[..., 0], words[..., 1]] = vals.to(torch.uint8)
    return out


@lru_cache(maxsize=None)
def _fragment_words(head_dim: int, tensor: PageTensor) -> Tensor:
    """[words in fragment order, code j of the word, (token, channel)] from the operand maps:
    a word's pair i (codes i and i + 8) is one fragment register, its low half code i."""
    d = head_dim
    if tensor == PageTensor.K:
        op = k_operand(d)  # [mt, lane, kk, reg, half, 2]
        kw = d // 64
        # words per (mt, lane): row r (0, 1), word w; pair i of word w sits in k-tile 4w + i // 2,
        # register slot i % 2 (rows: register 2·slot + r)
        out = torch.empty(4, LANES, 2, kw, 16, 2, dtype=torch.long)
        for w in range(kw):
            for i in range(8):
                kk, slot = 4 * w + i // 2, i % 2
                for r in range(2):
                    reg = 2 * slot + r
                    out[:, :, r, w, i] = op[:, :, kk, reg, 0]
                    out[:, :, r, w, i + 8] = op[:, :, kk, reg, 1]
        return out.reshape(-1, 16, 2)
    op = v_operand(d)  # [kt, lane, md, reg, half, 2]
    ng = d // 64
    # words per (kt, lane): token pair tp, group grp; pair i = channel 8g + i of both tokens:
    # m-tile 4·grp + i // 2, register 2·tp + i % 2; low half token A (half 0), high half token B.
    out = torch.empty(4, LANES, 2, ng, 16, 2, dtype=torch.long)
    for tp in range(2):
        for grp in range(ng):
            for i in range(8):
                md, reg = 4 * grp + i // 2, 2 * tp + i % 2
                out[:, :, tp, grp, i] = op[:, :, md, reg, 0]
                out[:, :, tp, grp, i + 8] = op[:, :, md, reg, 1]
    return out.reshape(-1, 16, 2)
