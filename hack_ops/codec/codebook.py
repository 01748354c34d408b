"""The per-model exponent codebook: the 16 most frequent exponents of its KV cache.

Calibrated once from a few prompts (`hack codec calibrate`) and stored next to the prepared
model as kv_codebook.json; without one, DEFAULT_* (zero and the exponents of values between
2^-11 and 2^3, where the KV of small LLMs sits) is used. Both sides of a transfer must use the same
codebook: its `ident` is written in every stream and in the PD layout fingerprint.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from .format import CODEBOOK_SIZE, FloatFormat

FILE_NAME = "kv_codebook.json"

# Biased exponents: BF16 bias 127, FP16 bias 15. Exponent 0 (zeros) is always in the book:
# KV pages carry unused token slots (the open page of a request), zero in a fresh pool, and
# as escapes they would make that page code worse than raw.
ZERO_EXPONENT = 0
DEFAULT_EXPONENTS = {
    FloatFormat.BF16: (ZERO_EXPONENT, *range(116, 131)),  # 0 and 2^-11 .. 2^3
    FloatFormat.FP16: (ZERO_EXPONENT, *range(4, 19)),  # 0 and 2^-11 .. 2^3
}


@dataclass(frozen=True)
class Codebook:
    fmt: FloatFormat
    exponents: tuple[int, ...]  # code i -> biased exponent exponents[i]

    def __post_init__(self) -> None:
        limit = 1 << self.fmt.exp_bits
        if len(self.exponents) != CODEBOOK_SIZE or len(set(self.exponents)) != CODEBOOK_SIZE:
            raise ValueError(f"a codebook holds {CODEBOOK_SIZE} distinct exponents, got {self.exponents}")
        if not all(0 <= e < limit for e in self.exponents):
            raise ValueError(f"{self.fmt.name} exponents lie in 0..{limit - 1}, got {self.exponents}")

    @property
    def ident(self) -> int:
        """A 32-bit id (CRC-32 of format + exponents): streams carry it, decoders check it."""
        return zlib.crc32(bytes([int(self.fmt), *self.exponents]))

    def table(self) -> torch.Tensor:
        return torch.tensor(self.exponents, dtype=torch.uint8)

    def encode_lut(self) -> torch.Tensor:
        """256 entries: exponent -> code, 0xFF for an exponent outside the codebook."""
        lut = torch.full((256,), 0xFF, dtype=torch.uint8)
        lut[torch.tensor(self.exponents, dtype=torch.long)] = torch.arange(CODEBOOK_SIZE, dtype=torch.uint8)
        return lut

    def to_dict(self) -> dict:
        return {"format": self.fmt.name.lower(), "exponents": list(self.exponents)}

    @classmethod
    def from_dict(cls, d: dict) -> "Codebook":
        return cls(FloatFormat[d["format"].upper()], tuple(int(e) for e in d["exponents"]))


def default(fmt: FloatFormat) -> Codebook:
    return Codebook(fmt, DEFAULT_EXPONENTS[fmt])


def exponent_histogram(t: torch.Tensor) -> torch.Tensor:
    """Counts of each biased exponent value (256 bins; FP16 uses the first 32)."""
    fmt = FloatFormat.of(t.dtype)
    w = t.contiguous().view(torch.int16).reshape(-1).to(torch.int32) & 0xFFFF
    shift = 7 if fmt is FloatFormat.BF16 else 10
    e = (w >> shift) & ((1 << fmt.exp_bits) - 1)
    return torch.bincount(e, minlength=256)[:256]


def from_histogram(fmt: FloatFormat, hist: torch.Tensor) -> Codebook:
    """Exponent 0 plus the 15 most frequent other exponents (ties: the smaller exponent), in
    ascending order."""
    limit = 1 << fmt.exp_bits
    h = hist[:limit].to(torch.float64)
    order = sorted(range(1, limit), key=lambda e: (-float(h[e]), e))
    return Codebook(fmt, tuple(sorted([ZERO_EXPONENT, *order[:CODEBOOK_SIZE - 1]])))


def calibrate(tensors: Iterable[torch.Tensor], fmt: FloatFormat) -> Codebook:
    hist = torch.zeros(256, dtype=torch.int64)
    for t in tensors:
        hist += exponent_histogram(t.to(fmt.torch_dtype))
    if int(hist.sum()) == 0:
        raise ValueError("calibration saw no values")
    return from_histogram(fmt, hist)


@dataclass(frozen=True)
class CodebookSet:
    """The codebooks of one model: one per float format, and where they came from."""

    books: dict
    source: str  # "calibrated (kv_codebook.json)" or "default"

    def get(self, fmt: FloatFormat) -> Codebook:
        return self.books.get(fmt) or default(fmt)

    @property
    def ident(self) -> int:
        return zlib.crc32(b"".join(self.get(f).ident.to_bytes(4, "little") for f in FloatFormat))

    def save(self, path: Path, meta: dict | None = None) -> None:
        doc = {"codebooks": [b.to_dict() for b in self.books.values()], **(meta or {})}
        path.write_text(json.dumps(doc, indent=1) + "\n")


def load(path: Path) -> CodebookSet:
    try:
        doc = json.loads(Path(path).read_text())
        books = {b.fmt: b for b in (Codebook.from_dict(d) for d in doc["codebooks"])}
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"cannot read the codebook file {path}: {exc}") from None
    return CodebookSet(books, f"calibrated ({Path(path).name})")


def for_model(model_path: str | Path | None) -> CodebookSet:
    """The model folder's kv_codebook.json if it has one, else the defaults."""
    if model_path is not None:
        p = Path(model_path) / FILE_NAME
        if p.is_file():
            return load(p)
    return CodebookSet({}, "default")
