"""Packing b-bit codes into bytes, along the last dimension.

Bit order (little-endian within a byte): with k = 8 // bits codes per byte, code i of each run
of k consecutive codes sits in bits [i*bits, (i+1)*bits) of its byte. For 2 bits, the byte
holding codes c0..c3 is c0 | c1 << 2 | c2 << 4 | c3 << 6. A last dimension that is not a
multiple of k is padded with zero codes; `unpack` takes the true length back.
"""
from __future__ import annotations

import torch
from torch import Tensor

PACK_BITS = (2, 4, 8)


def _per_byte(bits: int) -> int:
    if bits not in PACK_BITS:
        raise ValueError(f"bits must be one of {PACK_BITS}, got {bits!r}")
    return 8 // bits


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack uint8 codes (each < 2**bits) along the last dim into uint8 bytes."""
    k = _per_byte(bits)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if codes.dim() == 0:
        raise ValueError("codes must have at least one dimension")
    if bits < 8 and codes.numel() and int(codes.max()) >= (1 << bits):
        raise ValueError(f"codes exceed {bits} bits (max {int(codes.max())})")
    if k == 1:
        return codes.contiguous().clone()
    n = codes.shape[-1]
    pad = (-n) % k
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    c = codes.reshape(*codes.shape[:-1], -1, k).to(torch.int32)
    shifts = torch.arange(k, dtype=torch.int32, device=codes.device) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of `pack`: returns uint8 codes with last dim n."""
    k = _per_byte(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    if not 0 <= n <= packed.shape[-1] * k or n <= packed.shape[-1] * k - k:
        raise ValueError(f"n={n} does not match {packed.shape[-1]} packed bytes of {k} codes")
    if k == 1:
        return packed.clone()
    shifts = torch.arange(k, dtype=torch.int32, device=packed.device) * bits
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.uint8)
