"""The attention modes, one meaning per name, the same in flags, code and docs.

AttentionMode: how attention reads K and V.
  exact    no quantization: every key and value at full precision (the dense reference's
           accuracy baseline; no cache is involved, so the paged paths do not take it)
  hack     the 2-bit pages read homomorphically (Eq. 4 on the codes, nothing dequantized)
  dequant  the same 2-bit pages dequantized, then float attention (the paper's strawman)
`--hack-attention` takes the two the server runs (SERVING_MODES).

PrefillMode: how extend (prefill) attention reads the chunk's own new tokens (`--hack-prefill`).
  auto         the server's default, resolved once at startup (engine.prefill_choice): dense on
               a CPU with AMX-BF16 serving a BF16 model, on a CPU without AVX-512 VNNI and on a
               GPU; int8 on the other CPUs (homomorphic for layouts int8 does not read). Only the
               server resolves it; the kernels take one of the four below
  homomorphic  as decode will see them later: through the quantized cache (decode-time visibility)
  int8         as homomorphic (the same INT8 kernel and visibility), but the pages from the
               prefix's open page on are read from 6-bit codes of the FP16 tokens
               (hack_ops.paged.chunk_codes) instead of the pool's 2-bit ones: the chunk's own
               tokens nearly at full precision, the cached prefix as decode reads it
  exact        at full precision (FP16 as stored); the cached prefix is still read by the
               AttentionMode, so only the chunk's own tokens differ
  dense        at full precision, and the cached prefix dequantized once for the chunk: both by
               dense attention (SDPA, BF16 for a BF16 model), as a dequantizing system prefills.
               Only prefill changes: decode still reads the codes by the AttentionMode
"""
from __future__ import annotations

from enum import StrEnum


class AttentionMode(StrEnum):
    EXACT = "exact"
    HACK = "hack"
    DEQUANT = "dequant"


class PrefillMode(StrEnum):
    AUTO = "auto"
    HOMOMORPHIC = "homomorphic"
    INT8 = "int8"
    EXACT = "exact"
    DENSE = "dense"


# The modes a server runs and the paged decode/extend take (exact needs no cache at all).
SERVING_MODES = (AttentionMode.HACK, AttentionMode.DEQUANT)
# The prefill modes an extend runs: 'auto' is a server setting, resolved before any extend.
EXTEND_PREFILL_MODES = (PrefillMode.HOMOMORPHIC, PrefillMode.INT8, PrefillMode.EXACT, PrefillMode.DENSE)


def _member(enum: type[StrEnum], mode: object, allowed: tuple, what: str):
    """mode as a member of `enum` within `allowed`, or ValueError naming the allowed values."""
    if type(mode) is enum and mode in allowed:  # (a member already: every layer of a step asks)
        return mode
    try:
        m = enum(mode)
    except ValueError:
        m = None
    if m not in allowed:
        raise ValueError(f"{what} must be one of {tuple(a.value for a in allowed)}, got {mode!r}")
    return m


def attention_mode(mode: AttentionMode | str, allowed: tuple[AttentionMode, ...] = tuple(AttentionMode),
                   what: str = "mode") -> AttentionMode:
    """mode as an AttentionMode, or ValueError naming the allowed values."""
    return _member(AttentionMode, mode, allowed, what)


def prefill_mode(mode: PrefillMode | str, allowed: tuple[PrefillMode, ...] = tuple(PrefillMode),
                 what: str = "prefill") -> PrefillMode:
    """mode as a PrefillMode, or ValueError naming the allowed values."""
    return _member(PrefillMode, mode, allowed, what)
