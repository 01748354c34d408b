"""The SplitZip stream format: a lossless code for tensors of 16-bit floats (BF16, FP16).

Each 16-bit word splits into its exponent field and the rest (sign + mantissa). A per-model
codebook lists the 16 most frequent exponents; the stream keeps, per chunk of `chunk`
elements:
  - a dense plane of 4-bit codes (the exponent's index in the codebook; 15 at escapes),
  - the sign/mantissa planes verbatim (BF16: one byte per element; FP16: the low mantissa
    byte, plus a 3-bit plane of sign and the top two mantissa bits, 8 elements per 3 bytes),
  - a sparse escape stream for exponents outside the codebook: k u16 positions (within the
    chunk), then k u8 exponent values.
A chunk whose coded form would not be smaller than raw is stored raw (its words, little
endian), so any input costs at most raw size + HEADER_BYTES + 4 bytes per chunk.

Layout (all little endian):
  header   16 B: b"SZ", version u8, dtype u8, n_elements u32, chunk u32, codebook id u32
  directory u32 per chunk: bit 31 = raw, bits 0..30 = escape count of a coded chunk
  payloads  one per chunk, in order, no padding
A coded chunk of n elements is ceil(n/2) + n [+ 3*ceil(n/8) for FP16] + 3k bytes.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import torch

MAGIC = b"SZ"
VERSION = 1
HEADER_BYTES = 16
DIR_ENTRY_BYTES = 4
RAW_FLAG = 1 << 31
DEFAULT_CHUNK = 4096  # elements; positions fit u16 and the directory costs 0.05%
MAX_CHUNK = 65536
CODEBOOK_SIZE = 16
ESCAPE_NIBBLE = 15  # the code stored where the escape stream holds the exponent


class FloatFormat(enum.IntEnum):
    """The 16-bit float formats the codec knows (value = the header's dtype byte)."""

    BF16 = 1
    FP16 = 2

    @property
    def exp_bits(self) -> int:
        return 8 if self is FloatFormat.BF16 else 5

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self is FloatFormat.BF16 else torch.float16

    @classmethod
    def of(cls, dtype: torch.dtype) -> "FloatFormat":
        if dtype == torch.bfloat16:
            return cls.BF16
        if dtype == torch.float16:
            return cls.FP16
        raise ValueError(f"the codec codes bfloat16 and float16 tensors, not {dtype}")


class CodecError(ValueError):
    """A stream that cannot be decoded (damaged, truncated, or made for another codebook)."""


@dataclass(frozen=True)
class Header:
    fmt: FloatFormat
    n: int
    chunk: int
    codebook_id: int

    @property
    def num_chunks(self) -> int:
        return (self.n + self.chunk - 1) // self.chunk

    def pack(self) -> bytes:
        return MAGIC + struct.pack("<BBIII", VERSION, int(self.fmt), self.n, self.chunk, self.codebook_id)

    @classmethod
    def unpack(cls, buf: bytes) -> "Header":
        if len(buf) < HEADER_BYTES:
            raise CodecError(f"stream of {len(buf)} bytes is shorter than its {HEADER_BYTES}-byte header")
        if bytes(buf[:2]) != MAGIC:
            raise CodecError("not a SplitZip stream (bad magic)")
        ver, fmt, n, chunk, cb = struct.unpack("<BBIII", bytes(buf[2:HEADER_BYTES]))
        if ver != VERSION:
            raise CodecError(f"SplitZip stream version {ver}, this codec reads version {VERSION}")
        if fmt not in (1, 2):
            raise CodecError(f"unknown float format {fmt} in the stream header")
        if chunk <= 0 or chunk % 8 or chunk > MAX_CHUNK:
            raise CodecError(f"bad chunk size {chunk} in the stream header")
        return cls(FloatFormat(fmt), n, chunk, cb)


def check_chunk(chunk: int) -> None:
    if chunk <= 0 or chunk % 8 or chunk > MAX_CHUNK:
        raise ValueError(f"chunk must be a positive multiple of 8 up to {MAX_CHUNK}, got {chunk}")


def coded_chunk_bytes(fmt: FloatFormat, n: int, escapes: int) -> int:
    hi = 3 * ((n + 7) // 8) if fmt is FloatFormat.FP16 else 0
    return (n + 1) // 2 + n + hi + 3 * escapes


def max_stream_bytes(n: int, chunk: int = DEFAULT_CHUNK) -> int:
    """The bound: raw bytes + header + one directory entry per chunk."""
    return HEADER_BYTES + DIR_ENTRY_BYTES * ((n + chunk - 1) // chunk) + 2 * n
