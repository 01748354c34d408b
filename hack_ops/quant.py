"""Asymmetric min/max group quantization (the reference every fast path is tested against).

A group of G consecutive elements along `dim` is stored as integer codes c in [0, 2^b - 1],
a minimum m and a scale s, with x ≈ s * c + m. The code sums per group are kept too: Eq. 4 of
the paper needs them and summation elimination stores them instead of recomputing them.

Metadata rounding: m and s are stored in `meta_dtype`. To make the stored range cover the data
(so no code is clipped and stochastic rounding stays unbiased), m is rounded down and s up to
the next representable value, and codes are computed against the stored (rounded) values.
Non-finite input (NaN, ±inf) is rejected with ValueError: a NaN would silently poison a whole
group's range and every later attention step that reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

VALID_BITS = (2, 4, 8)


@dataclass
class QTensor:
    """A group-quantized tensor. codes has x's shape; scale/minimum/sums have x's shape with
    `dim` divided by `group_size`."""

    codes: Tensor  # uint8, unpacked (one code per element)
    scale: Tensor  # meta dtype
    minimum: Tensor  # meta dtype
    sums: Tensor  # integer code sums per group (uint8 / int16 / int32: the smallest that fits)
    bits: int
    dim: int
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


def sums_dtype(bits: int, group_size: int) -> torch.dtype:
    """Smallest integer dtype holding a sum of `group_size` codes of `bits` bits."""
    top = ((1 << bits) - 1) * group_size
    if top <= 255:
        return torch.uint8
    if top <= 32767:
        return torch.int16
    return torch.int32


def group_code_sums(codes: Tensor, bits: int, group_size: int) -> Tensor:
    """Sums of `group_size` consecutive codes along the last dim (uint8 codes [..., n]) in
    sums_dtype: the one definition of the stored code sums (the store writes them, the PD
    decode side rebuilds them from received codes, hack_ops.page_wire)."""
    n = codes.shape[-1]
    if n % group_size:
        raise ValueError(f"the last dim ({n}) must be a multiple of group_size {group_size}")
    g = codes.reshape(*codes.shape[:-1], n // group_size, group_size)
    return g.sum(-1, dtype=torch.int32).to(sums_dtype(bits, group_size))


def _step_toward(x: Tensor, dtype: torch.dtype, down: bool) -> Tensor:
    """Round float32 x to `dtype` so that the result is <= x (down) or >= x (up)."""
    if dtype == torch.float32:
        return x.clone()
    y = x.to(dtype)
    yf = y.float()
    bad = (yf > x) if down else (yf < x)
    if bad.any():
        inf = torch.tensor(float("-inf") if down else float("inf"), dtype=dtype)
        y = torch.where(bad, torch.nextafter(y.float(), inf.float()).to(dtype), y)
        # nextafter in float32 can land between two `dtype` values; step in `dtype` bits instead.
        still = (y.float() > x) if down else (y.float() < x)
        if still.any():
            bits = y.view(torch.int16)
            neg = y.float() < 0
            zero = y.float() == 0
            delta = torch.where(neg, 1, -1) if down else torch.where(neg, -1, 1)
            stepped = torch.where(zero, torch.tensor(-32767 if down else 1, dtype=torch.int16),
                                  (bits + delta).to(torch.int16))
            y = torch.where(still, stepped.view(dtype), y)
    return y


CLIP_GRID = (0.0, 0.05, 0.1, 0.2, 0.3)


def _search_range(g: Tensor, m: Tensor | None, mn: Tensor, mx: Tensor, levels: int, meta_dtype) -> tuple[Tensor, Tensor]:
    """Per group, the clipped [lo, hi] from CLIP_GRID with the least squared error (ties keep
    the earlier candidate, so an unclipped range wins when clipping does not help)."""
    r = mx - mn
    best_err = None
    best_lo, best_hi = mn, mx
    for a in CLIP_GRID:
        for b in CLIP_GRID:
            lo = mn + a * r
            hi = mx - b * r
            lo_q = _step_toward(lo, meta_dtype, down=True).float()
            sc = _step_toward((hi - lo_q) / levels, meta_dtype, down=False).float()
            sc = torch.where(sc <= 0, torch.ones_like(sc), sc)
            c = torch.round((g - lo_q.unsqueeze(-1)) / sc.unsqueeze(-1)).clamp_(0, levels)
            e = (c * sc.unsqueeze(-1) + lo_q.unsqueeze(-1) - g) ** 2
            if m is not None:
                e = e * m
            err = e.sum(-1)
            if best_err is None:
                best_err = err
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo = torch.where(better, lo, best_lo)
            best_hi = torch.where(better, hi, best_hi)
    return best_lo, best_hi


def _check_input(x: Tensor, bits: int, dim: int, group_size: int, rounding: str) -> int:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if bits not in VALID_BITS:
        raise ValueError(f"bits must be one of {VALID_BITS}, got {bits!r}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim!r} is out of range for a {x.dim()}-D tensor")
    d = dim % x.dim()
    n = x.shape[d]
    if not isinstance(group_size, int) or group_size <= 0 or n % group_size:
        raise ValueError(f"group_size must be a positive divisor of x.shape[{dim}]={n}, got {group_size!r}")
    return d


def quantize(
    x: Tensor,
    bits: int,
    dim: int,
    group_size: int,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    meta_dtype: torch.dtype = torch.float16,
    mask: Tensor | None = None,
    zero_min: bool = False,
    check: bool = True,
    range_search: bool = False,
) -> QTensor:
    """Quantize x per group of `group_size` consecutive elements along `dim`.

    zero_min: for non-negative data (softmax numerators P): the range is [0, max], the stored
    minimum is exactly 0, so Eq. 4's minimum terms vanish (no code sums of the other operand).
    check=False skips the finiteness/sign scan, for internal operands known to be valid.
    range_search: pick, per group, the clipped range [min + a·r, max - b·r] (a, b from
    CLIP_GRID, r = max - min) whose nearest-rounded codes give the smallest squared error over
    the group's elements. At 2 bits one outlier otherwise spends the 4 levels on empty range.

    mask (optional, bool, x's shape): only True elements take part in a group's range; masked
    elements get code 0 and do not count in the sums. A fully masked group gets m = 0, s = 1.
    """
    d = _check_input(x, bits, dim, group_size, rounding)
    if check and not torch.isfinite(x if mask is None else x.masked_fill(~mask, 0)).all():
        raise ValueError("x contains NaN or inf; HACK quantization needs finite values")
    if check and zero_min and bool((x < 0).any()):
        raise ValueError("zero_min quantization needs non-negative x")
    levels = (1 << bits) - 1
    xf = x.float().movedim(d, -1)
    shape = xf.shape
    g = xf.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    if mask is None:
        mn = g.amin(-1)
        mx = g.amax(-1)
        m = None
    else:
        m = mask.movedim(d, -1).reshape(g.shape)
        mn = g.masked_fill(~m, float("inf")).amin(-1)
        mx = g.masked_fill(~m, float("-inf")).amax(-1)
        empty = ~m.any(-1)
        mn = torch.where(empty, torch.zeros_like(mn), mn)
        mx = torch.where(empty, torch.zeros_like(mx), mx)
    # A zero minimum is +0: which signed zero amin returns is the reduction kernel's choice,
    # and the stored bytes must not depend on it (the compiled store reproduces them).
    mn = mn + 0.0
    if zero_min:
        mn = torch.zeros_like(mn)
    if range_search:
        mn, mx = _search_range(g, m, mn, mx, levels, meta_dtype)
    flat = mx <= mn
    mn_q = _step_toward(mn, meta_dtype, down=True)
    raw_scale = (mx - mn_q.float()) / levels
    s_q = _step_toward(raw_scale, meta_dtype, down=False)
    s_q = torch.where((s_q.float() <= 0) | flat, torch.ones_like(s_q), s_q)  # zero range -> scale 1
    v = (g - mn_q.float().unsqueeze(-1)) / s_q.float().unsqueeze(-1)
    if rounding == "nearest":
        c = torch.round(v)
    else:
        u = torch.rand(v.shape, generator=generator, dtype=torch.float32)
        c = torch.floor(v + u)
    c = c.clamp_(0, levels)
    if m is not None:
        c = c.masked_fill(~m, 0)
    codes = c.to(torch.uint8)
    sums = group_code_sums(codes, bits, group_size).squeeze(-1)
    codes = codes.reshape(shape).movedim(-1, d).contiguous()
    return QTensor(
        codes=codes,
        scale=s_q.movedim(-1, d).contiguous(),
        minimum=mn_q.movedim(-1, d).contiguous(),
        sums=sums.movedim(-1, d).contiguous(),
        bits=bits,
        dim=d,
        group_size=group_size,
    )


def widest_channels(x: Tensor, n: int, group_size: int, mask: Tensor | None = None) -> Tensor:
    """Dense-and-sparse selection: for x [..., T, D] grouped along T (group_size consecutive
    tokens, e.g. one page), the n channels (last dim) of each group with the widest range
    max - min over the group's elements where `mask` (bool, x's shape) is True. Returns a bool
    [..., T // group_size, D] with exactly n True per group (ties: the lower channel index, so
    the choice is deterministic; a group with no True element picks channels 0..n-1)."""
    if x.dim() < 2:
        raise ValueError("x must be [..., tokens, channels]")
    t, d = x.shape[-2], x.shape[-1]
    if not isinstance(n, int) or not 0 <= n < d:
        raise ValueError(f"n must be an integer in 0..{d - 1} (head_dim {d}), got {n!r}")
    if group_size <= 0 or t % group_size:
        raise ValueError(f"group_size must be a positive divisor of {t}, got {group_size!r}")
    g = x.float().reshape(*x.shape[:-2], t // group_size, group_size, d)
    if mask is None:
        mn, mx = g.amin(-2), g.amax(-2)
    else:
        m = mask.expand(x.shape).reshape(g.shape)
        mn = g.masked_fill(~m, float("inf")).amin(-2)
        mx = g.masked_fill(~m, float("-inf")).amax(-2)
    r = torch.nan_to_num(mx - mn, nan=0.0, posinf=0.0, neginf=0.0).clamp_min(0)
    # Stable descending sort: equal ranges keep channel order (topk gives no such promise).
    idx = torch.sort(r, dim=-1, descending=True, stable=True).indices[..., :n]
    out = torch.zeros(r.shape, dtype=torch.bool)
    return out.scatter_(-1, idx, True)


def expand_groups(t: Tensor, dim: int, group_size: int) -> Tensor:
    """Repeat per-group values so they line up with the elements along `dim`."""
    return t.repeat_interleave(group_size, dim=dim)


def dequantize(qt: QTensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes * scale + minimum, broadcast per group. Only for baselines and tests: the HACK
    attention path never calls this."""
    s = expand_groups(qt.scale.float(), qt.dim, qt.group_size)
    m = expand_groups(qt.minimum.float(), qt.dim, qt.group_size)
    return (qt.codes.float() * s + m).to(dtype)
