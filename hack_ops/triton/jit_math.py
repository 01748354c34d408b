"""Element-wise Triton functions that reproduce hack_ops.quant bit for bit.

The store must write the same bytes as the PyTorch store, so every rounding step follows
hack_ops.quant exactly: IEEE division (`div_rn`; Triton's `/` lowers to the approximate
`div.full.f32`), round-half-to-even codes (torch.round), and min/scale rounded to fp16 toward
-inf / +inf so the stored range covers the data.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rint(x):
    """Round half to even, like torch.round (x - floor(x) is exact in fp32)."""
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def f16_down(x):
    """Largest fp16 value <= x (returned as fp16)."""
    y = x.to(tl.float16)
    yf = y.to(tl.float32)
    bits = y.to(tl.int16, bitcast=True).to(tl.int32)
    stepped = tl.where(yf == 0.0, -32767, tl.where(yf < 0.0, bits + 1, bits - 1))
    return tl.where(yf > x, stepped.to(tl.int16).to(tl.float16, bitcast=True), y)


@triton.jit
def f16_up(x):
    """Smallest fp16 value >= x (returned as fp16)."""
    y = x.to(tl.float16)
    yf = y.to(tl.float32)
    bits = y.to(tl.int16, bitcast=True).to(tl.int32)
    stepped = tl.where(yf == 0.0, 1, tl.where(yf < 0.0, bits - 1, bits + 1))
    return tl.where(yf < x, stepped.to(tl.int16).to(tl.float16, bitcast=True), y)


@triton.jit
def kv_meta(mn, mx, LEVELS: tl.constexpr, META_F16: tl.constexpr):
    """Stored (min, scale) for a group range [mn, mx], as fp32 values equal to what is stored:
    min rounded down, scale rounded up to the meta dtype; an empty range (mx <= mn) or a zero
    scale gets scale 1."""
    if META_F16:
        mn_q = f16_down(mn).to(tl.float32)
        s_q = f16_up(tl.math.div_rn(mx - mn_q, LEVELS * 1.0)).to(tl.float32)
    else:
        mn_q = mn
        s_q = tl.math.div_rn(mx - mn, LEVELS * 1.0)
    s_q = tl.where((s_q <= 0.0) | (mx <= mn), 1.0, s_q)
    return mn_q, s_q


@triton.jit
def _clip_grid(i: tl.constexpr):
    """hack_ops.quant.CLIP_GRID[i] = (0, 0.05, 0.1, 0.2, 0.3)[i], as a compile-time float."""
    return (i == 1) * 0.05 + (i == 2) * 0.1 + (i == 3) * 0.2 + (i == 4) * 0.3


@triton.jit
def search_range(x, valid, mn, mx, AXIS: tl.constexpr, LEVELS: tl.constexpr, META_F16: tl.constexpr):
    """hack_ops.quant range_search: among the clipped ranges [mn + a·r, mx - b·r] (a, b from
    CLIP_GRID, r = mx - mn) pick, per group along AXIS, the one whose nearest-rounded codes give
    the least squared error over the valid elements (ties keep the earlier candidate). Same
    operation order as the reference (the store launches without FMA contraction)."""
    r = mx - mn
    best_err = tl.zeros(mn.shape, tl.float32)
    best_lo = mn
    best_hi = mx
    for ia in tl.static_range(5):
        for ib in tl.static_range(5):
            lo = mn + _clip_grid(ia) * r
            hi = mx - _clip_grid(ib) * r
            if META_F16:
                lo_q = f16_down(lo).to(tl.float32)
                sc = f16_up(tl.math.div_rn(hi - lo_q, LEVELS * 1.0)).to(tl.float32)
            else:
                lo_q = lo
                sc = tl.math.div_rn(hi - lo_q, LEVELS * 1.0)
            sc = tl.where(sc <= 0.0, 1.0, sc)
            lo_e = tl.expand_dims(lo_q, AXIS)
            sc_e = tl.expand_dims(sc, AXIS)
            c = code_of(x, lo_e, sc_e, LEVELS)
            d = c * sc_e + lo_e - x
            err = tl.sum(tl.where(valid, d * d, 0.0), axis=AXIS)
            if ia + ib == 0:
                best_err = err
            else:
                better = err < best_err
                best_err = tl.where(better, err, best_err)
                best_lo = tl.where(better, lo, best_lo)
                best_hi = tl.where(better, hi, best_hi)
    return best_lo, best_hi


@triton.jit
def code_of(x, mn, s, LEVELS: tl.constexpr):
    """Integer code (as fp32) of x against a stored min/scale: round((x - mn) / s), clamped."""
    c = rint(tl.math.div_rn(x - mn, s))
    return tl.minimum(tl.maximum(c, 0.0), LEVELS * 1.0)


@triton.jit
def near_code(x, mn, inv_s, LEVELS: tl.constexpr):
    """Integer code (as fp32) of x on the attention side (INT8 Q' and P'): round((x - mn) * 1/s),
    clamped. Not the store's bit-exact code_of: a multiply by the row's reciprocal and
    round-half-up instead of an IEEE division and round-half-even per element. The two differ
    only where (x - mn) / s lies within an ulp of a half (a one-step code change, the kind of
    tie the kernels' tolerance already covers); the divisions were ~1/6 of a decode page step."""
    c = tl.floor((x - mn) * inv_s + 0.5)
    return tl.minimum(tl.maximum(c, 0.0), LEVELS * 1.0)


@triton.jit
def q8_along(x, AXIS: tl.constexpr):
    """INT8 min/max quantization of x along AXIS (hack_ops.quant, meta float32: exact min,
    scale (max - min) / 255, a zero range gets scale 1). Returns (code - 128, min, scale), the
    shifted code as fp32 (an exact integer in -128..127): the shift makes the 0..255 codes fit a
    signed INT8 MMA; the caller undoes it in int32 (dot + 128 * code sums of the other operand)."""
    mn = tl.min(x, axis=AXIS)
    mx = tl.max(x, axis=AXIS)
    s = (mx - mn) * (1.0 / 255.0)
    s = tl.where(s <= 0.0, 1.0, s)
    c = near_code(x, tl.expand_dims(mn, AXIS), tl.expand_dims(1.0 / s, AXIS), 255)
    return c - 128.0, mn, s


@triton.jit
def q8_zero_min_along(x, AXIS: tl.constexpr):
    """INT8 quantization of non-negative x along AXIS with a zero minimum (hack_ops.quant
    zero_min=True): scale max / 255 (zero -> 1). Returns (code - 128 as fp32, scale)."""
    s = tl.max(x, axis=AXIS) * (1.0 / 255.0)
    s = tl.where(s <= 0.0, 1.0, s)
    c = near_code(x, 0.0, tl.expand_dims(1.0 / s, AXIS), 255)
    return c - 128.0, s


@triton.jit
def _unpack_pairs(words, base: tl.constexpr, step: tl.constexpr, BITS: tl.constexpr):
    """Codes base and base + step of each word, joined along a new minor axis of 2."""
    m: tl.constexpr = (1 << BITS) - 1
    return tl.join((words >> (base * BITS)) & m, (words >> ((base + step) * BITS)) & m)


@triton.jit
def _unpack_words(words, BITS: tl.constexpr):
    """All 32 / BITS codes of each int32 word (2 or 4 bits), as [..., 2, 2, 2(, 2)]: reshaped to
    [..., 32 / BITS] they are in code order.
    Built from nested tl.join, whose new axes stay inside a thread: each thread expands the
    words it loaded in registers (a broadcast over a new axis spread the codes of one word over
    16 threads, and the tile then went to shared memory one byte at a time)."""
    if BITS == 2:  # 16 codes: k = 8·b3 + 4·b2 + 2·b1 + b0, the innermost join picks b0
        a = tl.join(tl.join(_unpack_pairs(words, 0, 8, BITS), _unpack_pairs(words, 4, 8, BITS)),
                    tl.join(_unpack_pairs(words, 2, 8, BITS), _unpack_pairs(words, 6, 8, BITS)))
        b = tl.join(tl.join(_unpack_pairs(words, 1, 8, BITS), _unpack_pairs(words, 5, 8, BITS)),
                    tl.join(_unpack_pairs(words, 3, 8, BITS), _unpack_pairs(words, 7, 8, BITS)))
        return tl.join(a, b)
    else:  # 4 bits: 8 codes
        return tl.join(tl.join(_unpack_pairs(words, 0, 4, BITS), _unpack_pairs(words, 2, 4, BITS)),
                       tl.join(_unpack_pairs(words, 1, 4, BITS), _unpack_pairs(words, 3, 4, BITS)))


@triton.jit
def code_rows(base, tok_stride, g, n_tok, GD: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr):
    """Codes (BITS bits) of head_dim group g of one head's page as [Π, Gd] int8, token-major
    (slots >= n_tok read as 0). K's tile enters QKᵀ transposed (tl.trans), the layout Triton's
    INT8 MMA takes without a byte-wise transpose."""
    PW: tl.constexpr = 32 // BITS
    W: tl.constexpr = GD // PW
    j = tl.arange(0, P)[:, None]
    w = tl.arange(0, W)[None, :]
    words = tl.load(base + j * tok_stride + g * W + w, mask=j < n_tok, other=0)  # [Π, W]
    return tl.reshape(_unpack_words(words, BITS), (P, GD)).to(tl.int8)


@triton.jit
def v_codes_tile(base, tok_stride, g, n_tok, GD: tl.constexpr, P: tl.constexpr, V_BITS: tl.constexpr):
    """V codes (V_BITS bits) of head_dim group g of one head's page as [Π, Gd] int8 (slots
    >= n_tok read as 0), and their sums over the tokens, [Gd] int32."""
    PW: tl.constexpr = 32 // V_BITS
    W: tl.constexpr = GD // PW
    j = tl.arange(0, P)[:, None]
    w = tl.arange(0, W)[None, :]
    words = tl.load(base + j * tok_stride + g * W + w, mask=j < n_tok, other=0)  # [Π, W]
    k = tl.arange(0, PW)[None, None, :]
    c = (words[:, :, None] >> (k * V_BITS)) & ((1 << V_BITS) - 1)  # [Π, W, PW]
    return tl.reshape(c, (P, GD)).to(tl.int8), tl.reshape(tl.sum(c, axis=0), (GD,))


@triton.jit
def into_group(x2, g, NG: tl.constexpr):
    """[M, X] -> [M, NG, X], zero outside group g (to add into a grouped accumulator)."""
    return tl.where(tl.arange(0, NG)[None, :, None] == g, x2[:, None, :], 0.0)


@triton.jit
def int_dot(a, b, DOT_F16: tl.constexpr):
    """Exact integer product of INT8 (shifted) codes and K/V codes, as int32.
    DOT_F16 (GPUs without INT8 tensor-core MMA in Triton, e.g. V100): the same integers go
    through an fp16 MMA with fp32 accumulation, exact because |sum| < 2^24."""
    if DOT_F16:
        return tl.dot(a.to(tl.float16), b.to(tl.float16), out_dtype=tl.float32).to(tl.int32)
    else:
        return tl.dot(a, b, out_dtype=tl.int32)
