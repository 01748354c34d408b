"""The SplitZip codec in Triton (GPUs; tested on CPU under TRITON_INTERPRET=1).

Same bytes as hack_ops.codec.reference. One program per chunk:
  encode: a counting pass (escapes per chunk), the directory and chunk offsets from a device
          prefix sum, then a writing pass (nibble plane, sign/mantissa planes, escapes placed
          by a cumulative sum of the chunk's escape mask; raw chunks copied);
  decode: offsets from the directory, a dense pass over the planes, then (after a barrier)
          the escapes rewrite their elements from the stream's own planes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codebook import Codebook
from .format import (DEFAULT_CHUNK, DIR_ENTRY_BYTES, HEADER_BYTES, RAW_FLAG, CodecError, FloatFormat,
                     Header, check_chunk)


@triton.jit
def _exp_of(w, FP16: tl.constexpr):
    if FP16:
        return (w >> 10) & 0x1F
    return (w >> 7) & 0xFF


@triton.jit
def _count_kernel(x_ptr, n, lut_ptr, count_ptr, CHUNK: tl.constexpr, FP16: tl.constexpr):
    c = tl.program_id(0)
    offs = c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < n
    w = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    code = tl.load(lut_ptr + _exp_of(w, FP16)).to(tl.int32)
    esc = (code == 255) & mask
    tl.store(count_ptr + c, tl.sum(esc.to(tl.int32), axis=0))


@triton.jit
def _write_kernel(x_ptr, n, lut_ptr, dir_ptr, off_ptr, out_ptr, CHUNK: tl.constexpr, FP16: tl.constexpr):
    c = tl.program_id(0)
    base = c.to(tl.int64) * CHUNK
    m = tl.minimum(n - base, CHUNK)
    d = tl.load(dir_ptr + c)
    o = tl.load(off_ptr + c)
    i = tl.arange(0, CHUNK)
    mask = i < m
    w = tl.load(x_ptr + base + i, mask=mask, other=0).to(tl.int32) & 0xFFFF
    if d < 0:  # raw flag (bit 31)
        tl.store(out_ptr + o + 2 * i, (w & 0xFF).to(tl.uint8), mask=mask)
        tl.store(out_ptr + o + 2 * i + 1, (w >> 8).to(tl.uint8), mask=mask)
    else:
        nb = (m + 1) // 2
        h = tl.arange(0, CHUNK // 2)
        we = tl.load(x_ptr + base + 2 * h, mask=2 * h < m, other=0).to(tl.int32) & 0xFFFF
        wo = tl.load(x_ptr + base + 2 * h + 1, mask=2 * h + 1 < m, other=0).to(tl.int32) & 0xFFFF
        ce = tl.load(lut_ptr + _exp_of(we, FP16)).to(tl.int32) & 0xF  # 0xFF (escape) -> 15
        co = tl.load(lut_ptr + _exp_of(wo, FP16)).to(tl.int32) & 0xF
        ce = tl.where(2 * h < m, ce, 0)
        co = tl.where(2 * h + 1 < m, co, 0)
        tl.store(out_ptr + o + h, (ce | (co << 4)).to(tl.uint8), mask=h < nb)
        if FP16:
            lo = w & 0xFF
        else:
            lo = ((w >> 8) & 0x80) | (w & 0x7F)
        tl.store(out_ptr + o + nb + i, lo.to(tl.uint8), mask=mask)
        q = o + nb + m
        if FP16:
            G: tl.constexpr = CHUNK // 8
            g = tl.arange(0, G)
            j = tl.arange(0, 8)
            t = g[:, None] * 8 + j[None, :]
            wg = tl.load(x_ptr + base + t, mask=t < m, other=0).to(tl.int32) & 0xFFFF
            hi = (((wg >> 15) << 2) | ((wg >> 8) & 3)) & 7
            v = tl.sum(hi << (3 * j)[None, :], axis=1)
            ng = (m + 7) // 8
            tl.store(out_ptr + q + 3 * g, (v & 0xFF).to(tl.uint8), mask=g < ng)
            tl.store(out_ptr + q + 3 * g + 1, ((v >> 8) & 0xFF).to(tl.uint8), mask=g < ng)
            tl.store(out_ptr + q + 3 * g + 2, ((v >> 16) & 0xFF).to(tl.uint8), mask=g < ng)
            q = q + 3 * ng
        e = _exp_of(w, FP16)
        esc = (tl.load(lut_ptr + e).to(tl.int32) == 255) & mask
        slot = tl.cumsum(esc.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + q + 2 * slot, (i & 0xFF).to(tl.uint8), mask=esc)
        tl.store(out_ptr + q + 2 * slot + 1, (i >> 8).to(tl.uint8), mask=esc)
        tl.store(out_ptr + q + 2 * d + slot, e.to(tl.uint8), mask=esc)


@triton.jit
def _join(e, lo, hi, FP16: tl.constexpr):
    if FP16:
        return ((hi >> 2) << 15) | (e << 10) | ((hi & 3) << 8) | lo
    return ((lo & 0x80) << 8) | (e << 7) | (lo & 0x7F)


@triton.jit
def _hi_of(p_ptr, q, t, mask):
    gb = q + 3 * (t // 8)
    v = (tl.load(p_ptr + gb, mask=mask, other=0).to(tl.int32)
         | (tl.load(p_ptr + gb + 1, mask=mask, other=0).to(tl.int32) << 8)
         | (tl.load(p_ptr + gb + 2, mask=mask, other=0).to(tl.int32) << 16))
    return (v >> (3 * (t % 8))) & 7


@triton.jit
def _decode_kernel(in_ptr, dir_ptr, off_ptr, cb_ptr, out_ptr, n, err_ptr, CHUNK: tl.constexpr,
                   FP16: tl.constexpr, EB: tl.constexpr):
    c = tl.program_id(0)
    base = c.to(tl.int64) * CHUNK
    m = tl.minimum(n - base, CHUNK)
    d = tl.load(dir_ptr + c)
    o = tl.load(off_ptr + c)
    i = tl.arange(0, CHUNK)
    mask = i < m
    if d < 0:
        b0 = tl.load(in_ptr + o + 2 * i, mask=mask, other=0).to(tl.int32)
        b1 = tl.load(in_ptr + o + 2 * i + 1, mask=mask, other=0).to(tl.int32)
        tl.store(out_ptr + base + i, (b0 | (b1 << 8)).to(tl.int16), mask=mask)
    else:
        nb = (m + 1) // 2
        nib = tl.load(in_ptr + o + i // 2, mask=mask, other=0).to(tl.int32)
        code = (nib >> (4 * (i % 2))) & 0xF
        e = tl.load(cb_ptr + code).to(tl.int32)
        lo = tl.load(in_ptr + o + nb + i, mask=mask, other=0).to(tl.int32)
        q = o + nb + m
        hi = lo * 0
        if FP16:
            hi = _hi_of(in_ptr, q, i, mask)
            q = q + 3 * ((m + 7) // 8)
        tl.store(out_ptr + base + i, _join(e, lo, hi, FP16).to(tl.int16), mask=mask)
        tl.debug_barrier()  # escapes rewrite elements stored above
        emax = 31 if FP16 else 255
        for s in range(0, d, EB):
            k = s + tl.arange(0, EB)
            km = k < d
            pos = (tl.load(in_ptr + q + 2 * k, mask=km, other=0).to(tl.int32)
                   | (tl.load(in_ptr + q + 2 * k + 1, mask=km, other=0).to(tl.int32) << 8))
            ev = tl.load(in_ptr + q + 2 * d + k, mask=km, other=0).to(tl.int32)
            ok = km & (pos < m) & (ev <= emax)
            tl.atomic_add(err_ptr, tl.sum((km & ~ok).to(tl.int32), axis=0))
            plo = tl.load(in_ptr + o + nb + pos, mask=ok, other=0).to(tl.int32)
            phi = plo * 0
            if FP16:
                phi = _hi_of(in_ptr, o + nb + m, pos, ok)
            tl.store(out_ptr + base + pos, _join(ev, plo, phi, FP16).to(tl.int16), mask=ok)


def _m_per_chunk(n: int, chunk: int, nc: int, device: torch.device) -> torch.Tensor:
    m = torch.full((nc,), chunk, dtype=torch.int64, device=device)
    if nc:
        m[-1] = n - (nc - 1) * chunk
    return m


def _coded(fmt: FloatFormat, m: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    hi = 3 * ((m + 7) // 8) if fmt is FloatFormat.FP16 else 0
    return (m + 1) // 2 + m + hi + 3 * k


def encode(t: torch.Tensor, book: Codebook, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """The stream (uint8 tensor on t's device) of a BF16/FP16 tensor."""
    fmt = FloatFormat.of(t.dtype)
    if book.fmt is not fmt:
        raise ValueError(f"a {book.fmt.name} codebook cannot code a {fmt.name} tensor")
    check_chunk(chunk)
    dev = t.device
    x = t.contiguous().view(torch.int16).reshape(-1)
    n = x.numel()
    nc = (n + chunk - 1) // chunk
    lut = book.encode_lut().to(dev)
    counts = torch.zeros(max(nc, 1), dtype=torch.int32, device=dev)[:nc]
    fp16 = fmt is FloatFormat.FP16
    if nc:
        _count_kernel[(nc,)](x, n, lut, counts, CHUNK=chunk, FP16=fp16)
    m = _m_per_chunk(n, chunk, nc, dev)
    coded = _coded(fmt, m, counts.to(torch.int64))
    raw = coded >= 2 * m
    sizes = torch.where(raw, 2 * m, coded)
    start = HEADER_BYTES + DIR_ENTRY_BYTES * nc
    off = start + torch.cumsum(sizes, 0) - sizes
    total = start + int(sizes.sum().item()) if nc else start
    directory = torch.where(raw, torch.full_like(counts, RAW_FLAG - (1 << 32)), counts).to(torch.int32)
    out = torch.empty(total, dtype=torch.uint8, device=dev)
    out[:HEADER_BYTES] = torch.frombuffer(bytearray(Header(fmt, n, chunk, book.ident).pack()),
                                          dtype=torch.uint8).to(dev)
    out[HEADER_BYTES:start] = directory.view(torch.uint8)
    if nc:
        _write_kernel[(nc,)](x, n, lut, directory, off, out, CHUNK=chunk, FP16=fp16)
    return out


def decode(stream: torch.Tensor, book: Codebook, n: int | None = None) -> torch.Tensor:
    """The values of a stream (1-D, the codebook's dtype, on the stream's device)."""
    dev = stream.device
    h = Header.unpack(bytes(stream[:HEADER_BYTES].cpu().numpy()))
    if h.fmt is not book.fmt or h.codebook_id != book.ident:
        raise CodecError("stream was coded with another codebook or float format")
    if n is not None and n != h.n:
        raise CodecError(f"stream holds {h.n} values, {n} expected")
    nc = h.num_chunks
    start = HEADER_BYTES + DIR_ENTRY_BYTES * nc
    if stream.numel() < start:
        raise CodecError("stream truncated inside its chunk directory")
    directory = stream[HEADER_BYTES:start].contiguous().view(torch.int32)
    m = _m_per_chunk(h.n, h.chunk, nc, dev)
    raw = directory < 0
    k = torch.where(raw, 0, directory).to(torch.int64)
    if bool((k > m).any()):
        raise CodecError("a chunk claims more escapes than elements")
    sizes = torch.where(raw, 2 * m, _coded(h.fmt, m, k))
    total = start + int(sizes.sum().item())
    if total != stream.numel():
        raise CodecError(f"stream length {stream.numel()} does not match its directory ({total})")
    off = start + torch.cumsum(sizes, 0) - sizes
    out = torch.empty(h.n, dtype=torch.int16, device=dev)
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    if nc:
        _decode_kernel[(nc,)](stream, directory, off, book.table().to(dev), out, h.n, err, CHUNK=h.chunk,
                              FP16=h.fmt is FloatFormat.FP16, EB=128)
    if int(err.item()):
        raise CodecError("escape stream out of range")
    return out.view(h.fmt.torch_dtype)


def aot_compile(cc: int) -> list[tuple[str, int]]:
    """Compile every kernel (BF16 and FP16, chunk 4096) for CUDA compute capability `cc` with no
    GPU present (catches what only works in the interpreter). Returns (kernel, shared bytes).
    Must run without TRITON_INTERPRET."""
    from triton.backends.compiler import GPUTarget

    kernels = (
        ("count", _count_kernel, {"x_ptr": "*i16", "n": "i64", "lut_ptr": "*u8", "count_ptr": "*i32"}, {}),
        ("write", _write_kernel, {"x_ptr": "*i16", "n": "i64", "lut_ptr": "*u8", "dir_ptr": "*i32",
                                  "off_ptr": "*i64", "out_ptr": "*u8"}, {}),
        ("decode", _decode_kernel, {"in_ptr": "*u8", "dir_ptr": "*i32", "off_ptr": "*i64", "cb_ptr": "*u8",
                                    "out_ptr": "*i16", "n": "i64", "err_ptr": "*i32"}, {"EB": 128}),
    )
    out = []
    for fp16 in (False, True):
        for name, fn, sig, extra in kernels:
            consts = {"CHUNK": DEFAULT_CHUNK, "FP16": fp16, **extra}
            full = {**sig, **{k: "constexpr" for k in consts}}
            k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=full, constexprs=consts),
                               target=GPUTarget("cuda", cc, 32))
            out.append((f"{name}_{'fp16' if fp16 else 'bf16'}", int(k.metadata.shared)))
    return out
