"""SplitZip: a lossless code for BF16/FP16 tensors (KV pages on their way between servers).

format.py holds the stream layout, codebook.py the per-model exponent codebook, reference.py
the NumPy reference, cpu.py the compiled C codec, triton_codec.py the GPU one. `encode` and
`decode` pick an implementation for the tensor's device (CodecBackend.AUTO).
"""
from __future__ import annotations

import enum

import torch

from .codebook import Codebook, CodebookSet, default, for_model
from .format import DEFAULT_CHUNK, CodecError, FloatFormat, max_stream_bytes


class CodecBackend(enum.Enum):
    AUTO = "auto"  # the compiled C codec on CPU tensors, Triton on GPU tensors
    CPU = "cpu"
    TRITON = "triton"
    REFERENCE = "reference"


def _pick(t: torch.Tensor, backend: CodecBackend) -> CodecBackend:
    if backend is not CodecBackend.AUTO:
        return backend
    if t.device.type != "cpu":
        return CodecBackend.TRITON
    from . import cpu

    return CodecBackend.CPU if cpu.why_not() is None else CodecBackend.REFERENCE


def encode(t: torch.Tensor, book: Codebook, chunk: int = DEFAULT_CHUNK,
           backend: CodecBackend = CodecBackend.AUTO) -> torch.Tensor:
    """The SplitZip stream (uint8 tensor) of a BF16/FP16 tensor of any shape."""
    b = _pick(t, backend)
    if b is CodecBackend.CPU:
        from . import cpu

        return cpu.encode(t, book, chunk)
    if b is CodecBackend.TRITON:
        from . import triton_codec

        return triton_codec.encode(t, book, chunk)
    from . import reference

    return torch.frombuffer(bytearray(reference.encode(t, book, chunk)), dtype=torch.uint8).to(t.device)


def decode(stream: torch.Tensor, book: Codebook, n: int,
           backend: CodecBackend = CodecBackend.AUTO) -> torch.Tensor:
    """The n values a stream holds (1-D, the codebook's dtype); CodecError if it is damaged."""
    b = _pick(stream, backend)
    if b is CodecBackend.CPU:
        from . import cpu

        return cpu.decode(stream, book, n)
    if b is CodecBackend.TRITON:
        from . import triton_codec

        return triton_codec.decode(stream, book, n)
    from . import reference

    out = reference.decode(stream.cpu().numpy().tobytes(), book)
    if out.numel() != n:
        raise CodecError(f"stream holds {out.numel()} values, {n} expected")
    return out.to(stream.device)


__all__ = ["Codebook", "CodebookSet", "CodecBackend", "CodecError", "FloatFormat", "decode", "default",
           "encode", "for_model", "max_stream_bytes"]
