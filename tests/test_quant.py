"""quantize / dequantize: asymmetric min/max groups, error bounds, metadata rounding, code sums,
stochastic rounding (unbiased, reproducible), masks, zero minimum, and the error paths."""
from __future__ import annotations

import math

import pytest
import torch

from hack_ops import QTensor, dequantize, quantize, sums_dtype


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _groups(x: torch.Tensor, dim: int, g: int) -> torch.Tensor:
    """x with `dim` split into (n/g, g) and the group axis last: [..., n/g, g]."""
    xm = x.movedim(dim, -1)
    return xm.reshape(*xm.shape[:-1], xm.shape[-1] // g, g)


def _per_group(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.movedim(dim, -1)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape,dim,g", [((8, 64), -1, 64), ((8, 64), -1, 16), ((64, 6), 0, 32),
                                          ((2, 3, 48, 5), 2, 16), ((2, 3, 48, 5), -2, 48), ((128,), 0, 128)])
@pytest.mark.parametrize("meta", [torch.float16, torch.float32])
def test_shapes_dtypes_sums_and_nearest_error_bound(bits, shape, dim, g, meta):
    x = torch.randn(shape, generator=_gen(1)) * 3 + 0.5
    qt = quantize(x, bits, dim=dim, group_size=g, meta_dtype=meta)
    d = dim % x.dim()
    gshape = list(shape)
    gshape[d] //= g
    assert isinstance(qt, QTensor)
    assert qt.codes.shape == x.shape and qt.codes.dtype == torch.uint8
    assert qt.scale.shape == tuple(gshape) and qt.minimum.shape == tuple(gshape) and qt.sums.shape == tuple(gshape)
    assert qt.scale.dtype == meta and qt.minimum.dtype == meta
    assert qt.sums.dtype == sums_dtype(bits, g)
    assert (qt.bits, qt.dim, qt.group_size, qt.shape) == (bits, d, g, x.shape)
    levels = 2**bits - 1
    assert int(qt.codes.max()) <= levels
    # Code sums per group, exactly.
    cs = _groups(qt.codes.long(), d, g).sum(-1)
    assert torch.equal(cs, _per_group(qt.sums.long(), d))
    # The stored range covers the data: m <= min, m + s*levels >= max, and it is tight
    # (at most a couple of meta-dtype ulps wider than the data's own range).
    xg = _groups(x, d, g)
    mn, mx = xg.amin(-1), xg.amax(-1)
    m = _per_group(qt.minimum.float(), d)
    s = _per_group(qt.scale.float(), d)
    assert bool((m <= mn).all()) and bool((m + s * levels >= mx * (1 - 1e-6) - 1e-6).all())
    ulp = 2.0**-10 if meta == torch.float16 else 2.0**-23
    assert bool((s <= (mx - mn) / levels * (1 + 4 * ulp) + 4 * ulp * mn.abs() / levels + 1e-30).all())
    assert bool((mn - m <= 2 * ulp * mn.abs() + 1e-30).all())
    # Nearest rounding: every element within half a step of its dequantized value.
    err = (dequantize(qt) - x).abs()
    half_step = s.unsqueeze(-1).expand_as(xg) * 0.5
    assert bool((_groups(err, d, g) <= half_step * (1 + 1e-5) + 1e-6).all())


def test_dequantize_formula_and_dtype():
    x = torch.randn(4, 32, generator=_gen(2))
    qt = quantize(x, 2, dim=-1, group_size=8)
    s = qt.scale.float().repeat_interleave(8, -1)
    m = qt.minimum.float().repeat_interleave(8, -1)
    assert torch.equal(dequantize(qt), qt.codes.float() * s + m)
    assert dequantize(qt).dtype == torch.float32
    assert dequantize(qt, torch.float64).dtype == torch.float64
    assert dequantize(qt, torch.float16).dtype == torch.float16


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_error_shrinks_with_bits(bits):
    """Mean abs error of unit-normal data in groups of 64 is about range/(4*levels)."""
    x = torch.randn(256, 64, generator=_gen(3))
    err = float((dequantize(quantize(x, bits, dim=-1, group_size=64)) - x).abs().mean())
    rng = float((x.amax(-1) - x.amin(-1)).mean())
    expected = rng / (2**bits - 1) / 4  # uniform error on [-s/2, s/2]
    assert 0.7 * expected < err < 1.3 * expected


def test_extremes_are_exact_codes():
    """The group min gets code 0 and the group max the top code (nearest rounding)."""
    x = torch.randn(16, 32, generator=_gen(4))
    for bits in (2, 4, 8):
        qt = quantize(x, bits, dim=-1, group_size=32)
        assert torch.equal(qt.codes.gather(-1, x.argmin(-1, keepdim=True)), torch.zeros(16, 1, dtype=torch.uint8))
        top = torch.full((16, 1), 2**bits - 1, dtype=torch.uint8)
        assert torch.equal(qt.codes.gather(-1, x.argmax(-1, keepdim=True)), top)


@pytest.mark.parametrize("meta", [torch.float16, torch.float32])
def test_zero_range_group_gets_scale_one(meta):
    x = torch.randn(3, 32, generator=_gen(5))
    x[1, 16:] = 0.125  # second group of row 1 is constant
    x[2, :16] = -7.0
    qt = quantize(x, 2, dim=-1, group_size=16, meta_dtype=meta)
    assert float(qt.scale[1, 1]) == 1.0 and float(qt.scale[2, 0]) == 1.0
    assert int(qt.codes[1, 16:].max()) == 0 and int(qt.sums[1, 1]) == 0
    assert float(qt.minimum[1, 1]) == 0.125 and float(qt.minimum[2, 0]) == -7.0
    back = dequantize(qt)
    assert torch.equal(back[1, 16:], x[1, 16:]) and torch.equal(back[2, :16], x[2, :16])
    assert float(qt.scale[0, 0]) != 1.0  # other groups are unaffected


def test_zero_range_group_not_fp16_representable_gets_scale_one():
    x = torch.full((1, 16), 0.1)
    qt = quantize(x, 2, dim=-1, group_size=16, meta_dtype=torch.float16)
    assert float(qt.scale[0, 0]) == 1.0
    assert int(qt.codes.max()) == 0
    assert int(qt.codes.max()) == 0
    assert float((dequantize(qt) - x).abs().max()) <= 2.0**-14  # one fp16 ulp at 0.1


def test_all_zero_tensor():
    qt = quantize(torch.zeros(2, 64), 2, dim=-1, group_size=64)
    assert torch.equal(qt.scale.float(), torch.ones(2, 1))
    assert torch.equal(qt.minimum.float(), torch.zeros(2, 1))
    assert torch.equal(dequantize(qt), torch.zeros(2, 64))


def test_input_dtypes_fp16_bf16_float64():
    x = torch.randn(4, 64, generator=_gen(6))
    ref = quantize(x.half().float(), 2, dim=-1, group_size=32)
    got = quantize(x.half(), 2, dim=-1, group_size=32)
    assert torch.equal(ref.codes, got.codes) and torch.equal(ref.scale, got.scale)
    qb = quantize(x.bfloat16(), 4, dim=-1, group_size=32)
    assert float((dequantize(qb) - x.bfloat16().float()).abs().max()) <= float(qb.scale.float().max()) / 2 * 1.001
    q64 = quantize(x.double(), 4, dim=-1, group_size=32)
    assert q64.codes.dtype == torch.uint8


def test_metadata_rounding_never_clips_codes():
    """Values whose fp16 rounding would shrink the range: min rounded up or scale rounded down
    would clip the extremes. Stored min must be <= true min and range must cover the max."""
    # 1/3 and similar are not fp16-representable; nearest fp16 of 0.1 is above 0.1 (0.1000977).
    x = torch.tensor([[0.1, 0.3, 1.0 / 3.0, 0.7, 0.9, 2.0 / 3.0, 0.2, 0.70001]])
    for bits in (2, 4, 8):
        qt = quantize(x, bits, dim=-1, group_size=8)
        m, s = float(qt.minimum), float(qt.scale)
        assert m <= 0.1 and m + s * (2**bits - 1) >= 0.9
        # Stochastic: the floor/ceil codes stay within range so no clipping bias.
        v = (x - m) / s
        assert float(v.max()) <= 2**bits - 1 and float(v.min()) >= 0


def test_negative_and_large_values():
    x = torch.tensor([[-1000.0, -999.0, -500.5, -1.0e-3]])
    qt = quantize(x, 8, dim=-1, group_size=4)
    assert float(qt.minimum) <= -1000.0
    err = (dequantize(qt) - x).abs().max()
    assert float(err) <= float(qt.scale) / 2 + 1e-3


# ---- stochastic rounding -----------------------------------------------------------------

def test_stochastic_rounding_is_unbiased():
    """Mean of N independent stochastic quantizations of the same 64 values vs the values.

    Each dequantized element is x's floor or ceil level, so its standard deviation is at most
    s/2; the mean of N draws deviates by more than 5 standard errors (5 * s / (2 sqrt N)) with
    probability < 6e-7 per element. The same check applied to nearest rounding must fail, so
    the test does detect a biased rounding."""
    n = 4000
    x = torch.randn(64, generator=_gen(7))
    xr = x.expand(n, 64).contiguous()  # n rows, each quantized as its own 4 groups of 16
    qt = quantize(xr, 2, dim=-1, group_size=16, rounding="stochastic", generator=_gen(8))
    s = qt.scale.float()[0].repeat_interleave(16)
    assert torch.equal(qt.scale, qt.scale[:1].expand_as(qt.scale))  # same range in every row
    mean = dequantize(qt).double().mean(0).float()
    tol = 5 * s / (2 * math.sqrt(n))
    assert bool(((mean - x).abs() <= tol).all()), float(((mean - x).abs() / tol).max())
    # Aggregate: the mean signed bias over 64 elements, in units of s, is ~N(0, <1/(4*64*n)).
    z = ((mean - x) / s).double().mean() / math.sqrt(1 / (4 * 64 * n))
    assert abs(float(z)) < 5
    # Each draw is the floor or ceil level: within one step, never further.
    assert bool(((dequantize(qt) - x).abs() < s * (1 + 1e-6)).all())
    near = dequantize(quantize(xr[:1], 2, dim=-1, group_size=16))[0]
    assert bool(((near - x).abs() > tol).any())  # nearest rounding is biased per element


def test_stochastic_rounding_probabilities():
    """A value at fraction f between two levels rounds up with probability f."""
    n = 20000
    row = torch.tensor([0.0, 0.25, 0.5, 0.9, 3.0])  # range [0, 3], 2 bits: levels are integers
    x = row.expand(n, 5).contiguous()
    qt = quantize(x, 2, dim=-1, group_size=5, rounding="stochastic", generator=_gen(9))
    assert float(qt.scale[0, 0]) == 1.0 and float(qt.minimum[0, 0]) == 0.0
    up = qt.codes.float().mean(0)
    sd = torch.sqrt(row * (1 - row) / n)
    assert float(up[0]) == 0.0 and float(up[4]) == 3.0
    assert bool(((up[1:4] - row[1:4]).abs() <= 5 * sd[1:4]).all()), up


def test_stochastic_reproducible_with_generator():
    x = torch.randn(32, 64, generator=_gen(10))
    a = quantize(x, 2, dim=-1, group_size=32, rounding="stochastic", generator=_gen(11))
    b = quantize(x, 2, dim=-1, group_size=32, rounding="stochastic", generator=_gen(11))
    c = quantize(x, 2, dim=-1, group_size=32, rounding="stochastic", generator=_gen(12))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.sums, b.sums)
    assert not torch.equal(a.codes, c.codes)
    assert torch.equal(a.scale, c.scale) and torch.equal(a.minimum, c.minimum)  # ranges are not random
    # Codes differ from nearest but only by one level.
    n = quantize(x, 2, dim=-1, group_size=32)
    diff = (a.codes.int() - n.codes.int()).abs()
    assert int(diff.max()) == 1 and bool((diff > 0).any())
    cs = a.codes.reshape(32, 2, 32).long().sum(-1)
    assert torch.equal(cs, a.sums.long())


# ---- masks and zero minimum ---------------------------------------------------------------

def test_mask_excludes_elements_from_range_and_sums():
    x = torch.randn(4, 32, generator=_gen(13))
    mask = torch.ones(4, 32, dtype=torch.bool)
    mask[:, :3] = False
    x[:, :3] = 100.0  # outliers outside the mask must not set the range
    qt = quantize(x, 2, dim=-1, group_size=16, mask=mask)
    ref = quantize(x[:, 3:16], 2, dim=-1, group_size=13)  # the first group's unmasked part alone
    assert torch.equal(qt.scale[:, :1], ref.scale) and torch.equal(qt.minimum[:, :1], ref.minimum)
    assert torch.equal(qt.codes[:, 3:16], ref.codes)
    assert int(qt.codes[:, :3].max()) == 0
    assert torch.equal(qt.sums[:, 0].long(), ref.sums[:, 0].long())
    full = quantize(x[:, 16:], 2, dim=-1, group_size=16)
    assert torch.equal(qt.codes[:, 16:], full.codes) and torch.equal(qt.scale[:, 1:], full.scale)


def test_fully_masked_group_and_masked_nan_allowed():
    x = torch.randn(2, 32, generator=_gen(14))
    x[:, :16] = float("nan")  # masked out: not an error
    mask = torch.zeros(2, 32, dtype=torch.bool)
    mask[:, 16:] = True
    qt = quantize(x, 2, dim=-1, group_size=16, mask=mask)
    assert torch.equal(qt.minimum[:, 0].float(), torch.zeros(2)) and torch.equal(qt.scale[:, 0].float(), torch.ones(2))
    assert int(qt.codes[:, :16].max()) == 0 and int(qt.sums[:, 0].max()) == 0


def test_zero_min_for_nonnegative_data():
    p = torch.rand(8, 64, generator=_gen(15)) * 5
    qt = quantize(p, 8, dim=-1, group_size=32, zero_min=True, meta_dtype=torch.float32)
    assert torch.equal(qt.minimum, torch.zeros_like(qt.minimum))
    assert torch.allclose(qt.scale, p.reshape(8, 2, 32).amax(-1) / 255, rtol=1e-6, atol=0)
    assert float((dequantize(qt) - p).abs().max()) <= float(qt.scale.max()) / 2 * (1 + 1e-5)
    z = quantize(torch.zeros(2, 32), 8, dim=-1, group_size=32, zero_min=True)
    assert float(z.scale.float().min()) == 1.0 and int(z.codes.max()) == 0
    with pytest.raises(ValueError, match="non-negative"):
        quantize(p - 1, 8, dim=-1, group_size=32, zero_min=True)


# ---- sums dtype ---------------------------------------------------------------------------

@pytest.mark.parametrize("bits,g,dtype", [(2, 16, torch.uint8), (2, 64, torch.uint8), (2, 85, torch.uint8),
                                          (2, 86, torch.int16), (2, 128, torch.int16), (4, 17, torch.uint8),
                                          (4, 18, torch.int16), (8, 1, torch.uint8), (8, 2, torch.int16),
                                          (8, 128, torch.int16), (8, 129, torch.int32), (8, 256, torch.int32)])
def test_sums_dtype_smallest_that_fits(bits, g, dtype):
    assert sums_dtype(bits, g) == dtype


@pytest.mark.parametrize("bits,g", [(2, 256), (4, 128), (8, 256), (2, 85), (8, 128)])
def test_sums_do_not_overflow_at_the_top(bits, g):
    """Every code but one at the top level: the largest sums the dtype must hold."""
    x = torch.ones(3, g)
    x[:, 0] = 0.0
    qt = quantize(x, bits, dim=-1, group_size=g)
    assert int(qt.sums.long().min()) == (2**bits - 1) * (g - 1)


# ---- error paths and NaN ------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(x=torch.arange(8)), "floating-point"),
        (dict(x=torch.ones(8, dtype=torch.uint8)), "floating-point"),
        (dict(x=[1.0, 2.0]), "floating-point"),
        (dict(bits=3), "bits"),
        (dict(bits=1), "bits"),
        (dict(bits=16), "bits"),
        (dict(group_size=3), "group_size"),
        (dict(group_size=0), "group_size"),
        (dict(group_size=-4), "group_size"),
        (dict(group_size=16), "group_size"),  # larger than the dim
        (dict(group_size=4.0), "group_size"),
        (dict(rounding="up"), "rounding"),
        (dict(x=torch.tensor(1.0)), "dimension"),
    ],
)
def test_invalid_arguments_raise(kwargs, match):
    args = dict(x=torch.randn(2, 8), bits=2, dim=-1, group_size=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        quantize(**args)


def test_negative_dim_in_range():
    x = torch.randn(4, 8, generator=_gen(16))
    assert torch.equal(quantize(x, 2, dim=-2, group_size=4).codes, quantize(x, 2, dim=0, group_size=4).codes)


@pytest.mark.parametrize("dim", [2, -3])
def test_dim_out_of_range_raises(dim):
    with pytest.raises((ValueError, IndexError)):
        quantize(torch.randn(4, 8, generator=_gen(17)), 2, dim=dim, group_size=4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_rejected(bad):
    """Documented: NaN/inf would poison a whole group's range, so quantize raises."""
    x = torch.randn(2, 16)
    x[1, 5] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize(x, 2, dim=-1, group_size=8)
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize(x, 8, dim=-1, group_size=8, rounding="stochastic", generator=_gen(0))
