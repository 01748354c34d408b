"""SplitZip codec: bitwise round trips (reference, compiled C native/portable, Triton under the
interpreter), the raw fallback bound, damaged streams, the codebook and its calibration."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hack_ops.codec import CodecBackend, CodecError, decode, encode
from hack_ops.codec import codebook as cb
from hack_ops.codec import cpu, reference
from hack_ops.codec.format import HEADER_BYTES, FloatFormat, max_stream_bytes

DTYPES = (torch.bfloat16, torch.float16)
VARIANTS = ("native", "portable")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).reshape(-1)


def _special(dtype: torch.dtype) -> torch.Tensor:
    """NaNs (several payloads, both signs), +-Inf, subnormals, +-0, extremes, ordinary values."""
    f = torch.finfo(dtype)
    vals = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), f.max, -f.max, f.tiny,
                         -f.tiny, f.tiny / 4, -f.tiny / 8, f.eps, 1.0, -1.0, 0.5, 3.0], dtype=dtype)
    w = torch.tensor([0x7FC1, 0xFFC3, 0x7F81, 0x0001, 0x8001, 0x7E01] if dtype == torch.bfloat16
                     else [0x7E01, 0xFE03, 0x7C01, 0x0001, 0x8001, 0x7BFF], dtype=torch.int32)
    payload = w.to(torch.int16).view(dtype)
    return torch.cat([vals, payload]).repeat(300)


def _cases(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(5, 37, 3, 64, generator=g) * 0.3).to(dtype),  # KV-like, odd token count
        torch.randint(-32768, 32768, (9001,), generator=g, dtype=torch.int32).to(torch.int16).view(dtype),
        _special(dtype),
        (torch.randn(4096 * 2 + 8, generator=g) * 1e4).to(dtype),  # mostly escapes: raw chunks
        torch.zeros(7, dtype=dtype),
        torch.tensor(1.5, dtype=dtype),  # 0-d
        torch.empty(0, dtype=dtype),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_round_trip_bitwise(dtype: torch.dtype) -> None:
    book = cb.default(FloatFormat.of(dtype))
    for x in _cases(dtype):
        s = reference.encode(x, book)
        assert len(s) <= max_stream_bytes(x.numel())
        assert torch.equal(_bits(reference.decode(s, book)), _bits(x))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_matches_reference_bytes(dtype: torch.dtype, variant: str) -> None:
    if cpu.why_not(variant):
        pytest.skip(f"C codec unavailable: {cpu.why_not(variant)}")
    book = cb.default(FloatFormat.of(dtype))
    for chunk in (4096, 264):
        for x in _cases(dtype):
            s = cpu.encode(x, book, chunk=chunk, variant=variant)
            assert bytes(s.numpy()) == reference.encode(x, book, chunk=chunk)
            y = cpu.decode(s, book, x.numel(), variant=variant)
            assert torch.equal(_bits(y), _bits(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_threads_give_the_same_stream(dtype: torch.dtype) -> None:
    book = cb.default(FloatFormat.of(dtype))
    x = (torch.randn(50_000, generator=torch.Generator().manual_seed(1)) * 0.2).to(dtype)
    one = cpu.encode(x, book, threads=1)
    two = cpu.encode(x, book, threads=2)
    assert torch.equal(one, two)
    assert torch.equal(_bits(cpu.decode(two, book, x.numel(), threads=2)), _bits(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_interpreter_matches_reference(dtype: torch.dtype, monkeypatch) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    import importlib

    from hack_ops.codec import triton_codec

    triton_codec = importlib.reload(triton_codec)  # the interpreter flag is read at decoration
    book = cb.default(FloatFormat.of(dtype))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for x in _cases(dtype):
        x = x.reshape(-1)[:1200]  # small: the interpreter is slow
        s = triton_codec.encode(x.to(dev), book, chunk=256)
        assert bytes(s.cpu().numpy()) == reference.encode(x, book, chunk=256)
        assert torch.equal(_bits(triton_codec.decode(s, book, x.numel()).cpu()), _bits(x))


def test_fallback_bound_on_incompressible_data() -> None:
    """Random bits: every chunk falls back to raw; size = raw + header + 4 B per chunk."""
    book = cb.default(FloatFormat.BF16)
    x = torch.randint(-32768, 32768, (100_000,), generator=torch.Generator().manual_seed(2),
                      dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    s = encode(x, book)
    assert s.numel() == max_stream_bytes(x.numel()) == 2 * x.numel() + HEADER_BYTES + 4 * 25
    assert s.numel() <= 2 * x.numel() * 1.001 + HEADER_BYTES


def test_kv_like_data_is_coded_below_78_percent() -> None:
    book = cb.default(FloatFormat.BF16)
    x = (torch.randn(64, 3, 64, 30, generator=torch.Generator().manual_seed(3)) * 0.5).to(torch.bfloat16)
    assert encode(x, book).numel() / x.nbytes < 0.78
    x[40:] = 0  # a page's unused token slots: zeros code like any value, not as escapes
    assert encode(x, book).numel() / x.nbytes < 0.78


@pytest.mark.parametrize("backend", [CodecBackend.CPU, CodecBackend.REFERENCE])
def test_damaged_streams_are_refused(backend: CodecBackend) -> None:
    book = cb.default(FloatFormat.BF16)
    x = (torch.randn(10_000, generator=torch.Generator().manual_seed(4)) * 0.2).to(torch.bfloat16)
    s = encode(x, book, backend=backend)
    with pytest.raises(CodecError):
        decode(s[:-1], book, x.numel(), backend=backend)  # truncated
    bad = s.clone()
    bad[0] ^= 0xFF  # magic
    with pytest.raises(CodecError):
        decode(bad, book, x.numel(), backend=backend)
    bad = s.clone()
    bad[HEADER_BYTES] = 255  # chunk 0 claims 255 escapes: lengths no longer add up
    with pytest.raises(CodecError):
        decode(bad, book, x.numel(), backend=backend)
    other = cb.Codebook(FloatFormat.BF16, tuple(range(100, 116)))
    with pytest.raises(CodecError, match="codebook"):
        decode(s, other, x.numel(), backend=backend)


def test_escape_position_out_of_range_is_refused() -> None:
    """A chunk with escapes whose position byte is damaged fails, never writes outside."""
    book = cb.default(FloatFormat.BF16)
    x = torch.full((100,), 0.5, dtype=torch.bfloat16)
    x[10] = 1e30  # one escape
    s = bytearray(reference.encode(x, book))
    assert s[HEADER_BYTES] == 1
    pos = len(s) - 3  # the chunk ends with one u16 position and one u8 value
    s[pos:pos + 2] = (5000).to_bytes(2, "little")
    t = torch.frombuffer(s, dtype=torch.uint8)
    for backend in (CodecBackend.CPU, CodecBackend.REFERENCE):
        with pytest.raises(CodecError):
            decode(t, book, x.numel(), backend=backend)


def test_codebook_calibration_and_file(tmp_path) -> None:
    g = torch.Generator().manual_seed(5)
    xs = [(torch.randn(1000, generator=g) * 100).to(torch.bfloat16)]
    book = cb.calibrate(xs, FloatFormat.BF16)
    hist = cb.exponent_histogram(xs[0]).numpy()
    # exponent 0 is always in the book; the 15 most frequent others (ties: smaller) join it
    top = set((np.argsort(-hist[1:], kind="stable")[:15] + 1).tolist()) | {0}
    assert set(book.exponents) == top
    books = cb.CodebookSet({FloatFormat.BF16: book}, "test")
    books.save(tmp_path / cb.FILE_NAME)
    loaded = cb.for_model(tmp_path)
    assert loaded.get(FloatFormat.BF16) == book
    assert loaded.get(FloatFormat.FP16) == cb.default(FloatFormat.FP16)
    assert cb.for_model(tmp_path / "none").source == "default"
    (tmp_path / cb.FILE_NAME).write_text("{")
    with pytest.raises(ValueError, match="cannot read the codebook"):
        cb.for_model(tmp_path)
    with pytest.raises(ValueError):
        cb.Codebook(FloatFormat.FP16, tuple(range(20, 36)))  # FP16 exponents are 0..31


@pytest.mark.slow
def test_round_trip_on_real_kv() -> None:
    """Real KV of the prepared SmolLM2 (transformers), every layer's K and V, BF16 and FP16."""
    from hack_cli.codec_kv import collect
    from hack_eval.models import prepare

    kv = collect(prepare(log=lambda m: None), prompts=("The quick brown fox jumps over the lazy dog. " * 8,))
    for fmt in FloatFormat:
        book = cb.default(fmt)
        for k, v in kv:
            for t in (k.to(fmt.torch_dtype), v.to(fmt.torch_dtype)):
                s = encode(t, book)
                assert torch.equal(_bits(decode(s, book, t.numel())), _bits(t))
                if fmt is FloatFormat.BF16:
                    assert s.numel() / t.nbytes < 0.78


@pytest.mark.slow
def test_triton_kernels_compile_for_gpus() -> None:
    """Ahead-of-time compilation for sm80 and sm90 with no GPU (in a subprocess: the
    interpreter flag must be off)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from hack_ops.codec.triton_codec import aot_compile\n"
            "for cc in (80, 90):\n    print(cc, aot_compile(cc))\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.count("_bf16") == 3 and line.count("_fp16") == 3 for line in lines), r.stdout
