"""The Python (NumPy) reference of the SplitZip format: plain, chunk by chunk, for tests.

The compiled CPU codec (cpu.py) and the Triton one (triton_codec.py) must produce the same
bytes as `encode` and invert it exactly (tests/test_codec.py).
"""
from __future__ import annotations

import numpy as np
import torch

from .codebook import Codebook
from .format import (DEFAULT_CHUNK, DIR_ENTRY_BYTES, ESCAPE_NIBBLE, HEADER_BYTES, RAW_FLAG, CodecError,
                     FloatFormat, Header, check_chunk, coded_chunk_bytes)


def words_of(t: torch.Tensor) -> np.ndarray:
    """The tensor's 16-bit words, flattened (uint16)."""
    return t.detach().contiguous().view(torch.int16).reshape(-1).cpu().numpy().view(np.uint16)


def split(w: np.ndarray, fmt: FloatFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(exponent, low byte plane, FP16 3-bit sign+mantissa-top plane or None)."""
    if fmt is FloatFormat.BF16:
        e = (w >> 7) & 0xFF
        lo = ((w >> 8) & 0x80) | (w & 0x7F)
        return e.astype(np.uint8), lo.astype(np.uint8), None
    e = (w >> 10) & 0x1F
    lo = w & 0xFF
    hi = ((w >> 15) << 2) | ((w >> 8) & 3)
    return e.astype(np.uint8), lo.astype(np.uint8), hi.astype(np.uint8)


def join(e: np.ndarray, lo: np.ndarray, hi: np.ndarray | None, fmt: FloatFormat) -> np.ndarray:
    e = e.astype(np.uint16)
    lo = lo.astype(np.uint16)
    if fmt is FloatFormat.BF16:
        return ((lo & 0x80) << 8) | (e << 7) | (lo & 0x7F)
    hi = hi.astype(np.uint16)
    return ((hi >> 2) << 15) | (e << 10) | ((hi & 3) << 8) | lo


def _pack3(hi: np.ndarray) -> np.ndarray:
    """3 bits per element, 8 elements per 3 bytes (24-bit little-endian groups)."""
    g = np.zeros(((len(hi) + 7) // 8) * 8, dtype=np.uint32)
    g[: len(hi)] = hi
    g = g.reshape(-1, 8)
    v = np.zeros(len(g), dtype=np.uint32)
    for j in range(8):
        v |= g[:, j] << (3 * j)
    return np.stack([v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF], axis=1).astype(np.uint8).reshape(-1)


def _unpack3(b: np.ndarray, n: int) -> np.ndarray:
    v = b.reshape(-1, 3).astype(np.uint32)
    v = v[:, 0] | (v[:, 1] << 8) | (v[:, 2] << 16)
    out = np.stack([(v >> (3 * j)) & 7 for j in range(8)], axis=1).reshape(-1)
    return out[:n].astype(np.uint8)


def encode(t: torch.Tensor, book: Codebook, chunk: int = DEFAULT_CHUNK) -> bytes:
    fmt = FloatFormat.of(t.dtype)
    if book.fmt is not fmt:
        raise ValueError(f"a {book.fmt.name} codebook cannot code a {fmt.name} tensor")
    check_chunk(chunk)
    w = words_of(t)
    n = len(w)
    lut = book.encode_lut().numpy()
    header = Header(fmt, n, chunk, book.ident)
    directory = np.zeros(header.num_chunks, dtype=np.uint32)
    payloads = []
    for c in range(header.num_chunks):
        cw = w[c * chunk:(c + 1) * chunk]
        m = len(cw)
        e, lo, hi = split(cw, fmt)
        code = lut[e]
        esc = np.nonzero(code == 0xFF)[0]
        if coded_chunk_bytes(fmt, m, len(esc)) >= 2 * m:
            directory[c] = RAW_FLAG
            payloads.append(cw.astype("<u2").tobytes())
            continue
        directory[c] = len(esc)
        nib = np.where(code == 0xFF, ESCAPE_NIBBLE, code).astype(np.uint8)
        if m % 2:
            nib = np.append(nib, np.uint8(0))
        parts = [(nib[0::2] | (nib[1::2] << 4)).astype(np.uint8).tobytes(), lo.tobytes()]
        if hi is not None:
            parts.append(_pack3(hi).tobytes())
        parts += [esc.astype("<u2").tobytes(), e[esc].astype(np.uint8).tobytes()]
        payloads.append(b"".join(parts))
    return header.pack() + directory.astype("<u4").tobytes() + b"".join(payloads)


def decode(stream: bytes | bytearray | memoryview | np.ndarray, book: Codebook) -> torch.Tensor:
    """The flat tensor (1-D, the codebook's dtype) a stream holds; CodecError if damaged."""
    buf = np.frombuffer(bytes(stream), dtype=np.uint8)
    h = Header.unpack(buf)
    if h.fmt is not book.fmt:
        raise CodecError(f"stream holds {h.fmt.name}, the codebook is for {book.fmt.name}")
    if h.codebook_id != book.ident:
        raise CodecError(f"stream was coded with codebook {h.codebook_id:08x}, this side has {book.ident:08x}")
    nc = h.num_chunks
    pos = HEADER_BYTES + DIR_ENTRY_BYTES * nc
    if len(buf) < pos:
        raise CodecError("stream truncated inside its chunk directory")
    directory = buf[HEADER_BYTES:pos].view("<u4")
    table = np.array(book.exponents, dtype=np.uint8)
    out = np.empty(h.n, dtype=np.uint16)
    for c in range(nc):
        m = min(h.chunk, h.n - c * h.chunk)
        d = int(directory[c])
        if d & RAW_FLAG:
            size = 2 * m
        else:
            if d > m:
                raise CodecError(f"chunk {c} claims {d} escapes for {m} elements")
            size = coded_chunk_bytes(h.fmt, m, d)
        if pos + size > len(buf):
            raise CodecError(f"stream truncated in chunk {c}")
        p = buf[pos:pos + size]
        pos += size
        if d & RAW_FLAG:
            out[c * h.chunk:c * h.chunk + m] = p.view("<u2")
            continue
        nb = (m + 1) // 2
        nib = np.stack([p[:nb] & 0xF, p[:nb] >> 4], axis=1).reshape(-1)[:m]
        lo = p[nb:nb + m]
        q = nb + m
        hi = None
        if h.fmt is FloatFormat.FP16:
            nh = 3 * ((m + 7) // 8)
            hi = _unpack3(p[q:q + nh], m)
            q += nh
        e = table[nib]
        esc_pos = p[q:q + 2 * d].view("<u2").astype(np.int64)
        esc_val = p[q + 2 * d:q + 3 * d]
        if d and int(esc_pos.max()) >= m:
            raise CodecError(f"chunk {c} has an escape position outside the chunk")
        if d and int(esc_val.max()) >= (1 << h.fmt.exp_bits):
            raise CodecError(f"chunk {c} has an escape exponent out of range")
        e[esc_pos] = esc_val
        out[c * h.chunk:c * h.chunk + m] = join(e, lo, hi, h.fmt)
    if pos != len(buf):
        raise CodecError(f"stream has {len(buf) - pos} bytes after its last chunk")
    return torch.from_numpy(out.view(np.int16).copy()).view(h.fmt.torch_dtype)
