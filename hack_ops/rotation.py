"""An orthogonal per-head rotation of Q, K and V before they are quantized (HackConfig.rotation).

R = diag(s) · H / sqrt(D): H the Sylvester Walsh-Hadamard matrix of order D (a power of two),
s a sign vector (all +1, or a fixed seeded random ±1 diagonal). R is orthogonal (R Rᵀ = I), so
  scores   (Q R)(K R)ᵀ = Q Kᵀ             (rotate Q and K: scaling, windows, soft-caps unchanged)
  output   P (V R) Rᵀ = P V               (rotate V, rotate the attention output back)
in exact arithmetic. What changes is what the 2-bit quantizer sees: the rotation spreads an
outlier channel over all channels, flattening per-token ranges (good for per-token V), but it
also mixes an outlier channel of K into every channel (which can hurt per-channel K).

The rotation is linear and lives outside every kernel: the attention backend rotates the
layer's q/k/v once before the store and attention, and rotates the output back once after
(engine.backend); the dense reference (hack_ops.attention) does the same with these functions,
so every path (CPU kernels, Triton, torch, dequant strawman, exact prefill, PD transfer)
computes on rotated codes unchanged.
"""
from __future__ import annotations

import functools
import math
from enum import StrEnum

import torch
from torch import Tensor

# Fixed seed of the random sign diagonal: both PD sides and the study derive the same signs.
SIGN_SEED = 0x4841434B
# From this many elements a BF16 tensor rotates by one BF16 GEMM (_apply); measured on an AMD EPYC
# without AMX, one thread: the float32 path wins below ~256 rows of 64 channels, the GEMM above.
BF16_GEMM_MIN = 16384


# `--hack-rotation auto` / `hack calibrate --rotation auto`: not a rotation but where one comes from
# (the bit plan's on a server; measured and chosen by the calibration).
ROTATION_AUTO = "auto"


class Rotation(StrEnum):
    """Which tensors are rotated (`--hack-rotation`). K scope rotates Q and K (scores
    unchanged); V scope rotates V and the attention output back."""

    NONE = "none"
    HADAMARD_K = "hadamard_k"
    HADAMARD_V = "hadamard_v"
    HADAMARD_KV = "hadamard_kv"
    SIGNED_HADAMARD_V = "signed_hadamard_v"  # Hadamard times a fixed seeded random sign diagonal
    SIGNED_HADAMARD_KV = "signed_hadamard_kv"

    @property
    def rotates_k(self) -> bool:
        return self in (Rotation.HADAMARD_K, Rotation.HADAMARD_KV, Rotation.SIGNED_HADAMARD_KV)

    @property
    def rotates_v(self) -> bool:
        return self in (Rotation.HADAMARD_V, Rotation.HADAMARD_KV, Rotation.SIGNED_HADAMARD_V,
                        Rotation.SIGNED_HADAMARD_KV)

    @property
    def signed(self) -> bool:
        return self.value.startswith("signed_")


def rotation(value: Rotation | str) -> Rotation:
    """value as a Rotation, or ValueError naming the allowed values."""
    try:
        return Rotation(value)
    except ValueError:
        raise ValueError(f"rotation must be one of {tuple(r.value for r in Rotation)}, got {value!r}") from None


def head_dim_refusal(rot: Rotation | str, head_dim: int) -> str | None:
    """Why `rot` cannot rotate heads of size head_dim (a sentence), or None when it can."""
    if rotation(rot) == Rotation.NONE:
        return None
    if head_dim < 2 or head_dim & (head_dim - 1):
        return (f"--hack-rotation {rotation(rot).value} needs a head_dim that is a power of two "
                f"(a Walsh-Hadamard rotation), got head_dim {head_dim}; use --hack-rotation none")
    return None


def check_head_dim(rot: Rotation | str, head_dim: int) -> None:
    reason = head_dim_refusal(rot, head_dim)
    if reason:
        raise ValueError(reason)


def _signs(head_dim: int) -> Tensor:
    g = torch.Generator().manual_seed(SIGN_SEED + head_dim)
    return torch.randint(0, 2, (head_dim,), generator=g).float() * 2 - 1


@functools.lru_cache(maxsize=16)
def _matrix(head_dim: int, signed: bool, device: str) -> Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < head_dim:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    r = h / math.sqrt(head_dim)
    if signed:
        r = _signs(head_dim)[:, None] * r  # diag(s) · H / sqrt(D)
    return r.to(device)


def rotation_matrix(head_dim: int, signed: bool = False, device: torch.device | str = "cpu") -> Tensor:
    """The float32 [D, D] matrix R (x_rotated = x @ R)."""
    check_head_dim(Rotation.SIGNED_HADAMARD_KV if signed else Rotation.HADAMARD_KV, head_dim)
    return _matrix(int(head_dim), bool(signed), str(torch.device(device)))


def fwht(x: Tensor, signed: bool = False) -> Tensor:
    """x @ R by the fast Walsh-Hadamard transform (log2(D) butterfly stages) over the last dim,
    in float32. Same result as the matrix product up to float round-off; kept as the
    transform's own definition and for the cost comparison (hack bench rotation)."""
    d = x.shape[-1]
    check_head_dim(Rotation.HADAMARD_KV, d)
    y = x.float()
    if signed:
        y = y * _signs(d).to(y.device)
    shape = y.shape
    y = y.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(shape) / math.sqrt(d))


@functools.lru_cache(maxsize=16)
def _exact_bf16(head_dim: int, signed: bool, device: str) -> Tensor | None:
    """R in bfloat16 where that is R exactly (entries +-1/sqrt(D): a power of two when D is a
    power of four, e.g. 64 and 256), else None."""
    r = _matrix(head_dim, signed, device)
    b = r.to(torch.bfloat16)
    return b if torch.equal(b.float(), r) else None


def _apply(x: Tensor, signed: bool, inverse: bool) -> Tensor:
    # A D x D product beats the butterfly stages on the shapes a layer sees (hack bench rotation).
    # BF16 input times an R that BF16 holds exactly is one BF16 GEMM (float32 accumulation, one
    # rounding to BF16 at the end: the float32 product's result, to the last bit on the shapes
    # tested), 2-9x faster than the float32 path from BF16_GEMM_MIN elements on a CPU with
    # AVX-512 BF16 (a 2K prefill); below that (a decode step) its call costs more than the
    # product. Other inputs go through float32, so the rotation adds no rounding beyond the
    # caller's dtype.
    d = x.shape[-1]
    check_head_dim(Rotation.HADAMARD_KV, d)
    if x.dtype == torch.bfloat16 and x.numel() >= BF16_GEMM_MIN:
        rb = _exact_bf16(int(d), bool(signed), str(x.device))
        if rb is not None:
            return x @ (rb.T if inverse else rb)
    r = rotation_matrix(d, signed, x.device)
    return (x.float() @ (r.T if inverse else r)).to(x.dtype)


def rotate_qkv(q: Tensor, k: Tensor, v: Tensor, rot: Rotation | str) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (head_dim last, any leading shape) rotated as `rot` says, in their own dtypes.
    Call before the cache and attention; restore_output after."""
    rot = rotation(rot)
    if rot.rotates_k:
        q, k = _apply(q, rot.signed, False), _apply(k, rot.signed, False)
    if rot.rotates_v:
        v = _apply(v, rot.signed, False)
    return q, k, v


def restore_output(o: Tensor, rot: Rotation | str) -> Tensor:
    """The attention output over rotated V, rotated back by Rᵀ (identity when V is not rotated)."""
    rot = rotation(rot)
    return _apply(o, rot.signed, True) if rot.rotates_v else o
