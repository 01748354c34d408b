"""homomorphic_matmul (Eq. 1/4): equals the product of the dequantized operands to float32
round-off, uses the stored code sums (summation elimination), is unbiased under stochastic
rounding, and rejects operands it cannot multiply."""
from __future__ import annotations

import math

import pytest
import torch

from hack_ops import dequantize, homomorphic_matmul, homomorphic_matmul_q, quantize


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _operands(a_shape, b_shape, seed):
    g = _gen(seed)
    a = torch.randn(a_shape, generator=g) * 2 - 0.3
    b = torch.randn(b_shape, generator=g) + 0.7
    return a, b


def _dequant_product(a, b, g, a_bits, b_bits):
    """float64 product of the dequantized operands (the same quantization calls as documented:
    A grouped along its last dim, B along its first matmul dim, nearest, fp16 meta)."""
    qa = quantize(a, a_bits, dim=-1, group_size=g)
    qb = quantize(b, b_bits, dim=-2, group_size=g)
    da, db = dequantize(qa, torch.float64), dequantize(qb, torch.float64)
    return da @ db, da.abs() @ db.abs(), qa, qb


# Tolerance: the result is computed in float64 and rounded to float32 once, so it matches the
# float64 product of the dequantized operands to a few float32 ulps of the magnitude sum
# |A'| @ |B'| (the float64 accumulation error is ~1e-16 of that).
RTOL = 4 * 2.0**-24


@pytest.mark.parametrize("a_bits,b_bits", [(8, 2), (8, 4), (8, 8), (4, 2), (2, 2), (2, 8)])
@pytest.mark.parametrize("m,k,n,g", [(1, 16, 1, 16), (5, 64, 7, 16), (5, 64, 7, 32), (5, 64, 7, 64),
                                     (3, 128, 4, 64), (8, 96, 3, 32), (2, 256, 2, 256)])
def test_identity_against_dequantized_matmul(a_bits, b_bits, m, k, n, g):
    a, b = _operands((m, k), (k, n), seed=m * 1000 + k + n + g)
    ref, mag, _, _ = _dequant_product(a, b, g, a_bits, b_bits)
    got = homomorphic_matmul(a, b, g, a_bits=a_bits, b_bits=b_bits)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    err = (got.double() - ref).abs()
    assert bool((err <= RTOL * mag + 1e-30).all()), float((err / mag).max())
    # And against the float32 product of the dequantized operands (float32 accumulation order).
    qa = quantize(a, a_bits, dim=-1, group_size=g)
    qb = quantize(b, b_bits, dim=-2, group_size=g)
    f32 = dequantize(qa) @ dequantize(qb)
    assert torch.allclose(got, f32, rtol=0, atol=float(mag.max()) * k * 2.0**-23)


@pytest.mark.parametrize("batch", [(2,), (2, 3)])
def test_batched_operands(batch):
    a, b = _operands((*batch, 4, 64), (*batch, 64, 5), seed=11)
    ref, mag, _, _ = _dequant_product(a, b, 32, 8, 2)
    got = homomorphic_matmul(a, b, 32)
    assert got.shape == (*batch, 4, 5)
    assert bool(((got.double() - ref).abs() <= RTOL * mag).all())


def test_fp16_and_bf16_inputs():
    a, b = _operands((4, 64), (64, 6), seed=12)
    for dt in (torch.float16, torch.bfloat16):
        got = homomorphic_matmul(a.to(dt), b.to(dt), 32)
        ref, mag, _, _ = _dequant_product(a.to(dt).float(), b.to(dt).float(), 32, 8, 2)
        assert bool(((got.double() - ref).abs() <= RTOL * mag).all())


def test_quantization_error_is_what_remains():
    """Against the exact A @ B the error is the quantization error: with 8-bit A and 2-bit B of
    unit-normal data in groups of 64, about 0.2-0.45 of |A| @ |B|'s scale per inner element."""
    a, b = _operands((16, 64), (64, 16), seed=13)
    exact = (a.double() @ b.double())
    err2 = (homomorphic_matmul(a, b, 64, b_bits=2).double() - exact).abs().mean()
    err4 = (homomorphic_matmul(a, b, 64, b_bits=4).double() - exact).abs().mean()
    err8 = (homomorphic_matmul(a, b, 64, b_bits=8).double() - exact).abs().mean()
    assert err8 < err4 < err2
    assert float(err4 / err2) < 0.35  # 3 levels -> 15 levels: ~5x smaller steps
    rel2 = float(err2 / exact.abs().mean())
    assert 0.05 < rel2 < 0.6


@pytest.mark.parametrize("a_bits,b_bits,g", [(8, 2, 64), (8, 2, 32), (8, 4, 16), (4, 4, 128), (8, 8, 128)])
def test_summation_elimination_on_off_identical(a_bits, b_bits, g):
    a, b = _operands((6, 128), (128, 5), seed=14)
    on = homomorphic_matmul(a, b, g, a_bits, b_bits, summation_elimination=True)
    off = homomorphic_matmul(a, b, g, a_bits, b_bits, summation_elimination=False)
    assert torch.equal(on, off)


def test_summation_elimination_reads_the_stored_sums():
    """With SE the stored sums are used (not recomputed): corrupting them changes the result by
    exactly the Eq. 4 term they feed; without SE the codes are summed and nothing changes."""
    a, b = _operands((3, 64), (64, 4), seed=15)
    qa = quantize(a, 8, dim=-1, group_size=32)
    qb = quantize(b, 2, dim=-2, group_size=32)
    base = homomorphic_matmul_q(qa, qb, True)
    qb.sums = qb.sums.clone()
    qb.sums[1, 2] += 1  # group 1, column 2
    with_se = homomorphic_matmul_q(qa, qb, True)
    without = homomorphic_matmul_q(qa, qb, False)
    assert torch.equal(without, base)
    delta = (with_se - base).double()
    expected = torch.zeros(3, 4, dtype=torch.float64)
    expected[:, 2] = qa.minimum[:, 1].double() * qb.scale[1, 2].double()  # ma * sb * ΔΣqb
    assert torch.allclose(delta, expected, rtol=1e-5, atol=1e-5)
    qa.sums = qa.sums.clone()
    qa.sums[0, 0] += 2
    delta_a = (homomorphic_matmul_q(qa, qb, True) - with_se).double()
    assert torch.allclose(delta_a[0], 2 * qa.scale[0, 0].double() * qb.minimum[0].double(), rtol=1e-5, atol=1e-5)
    assert torch.equal(delta_a[1:], torch.zeros(2, 4, dtype=torch.float64))


def test_stochastic_expectation_is_exact_product():
    """Mean over N stochastic draws vs A @ B. Tolerance: 5 standard errors, using the sample
    standard deviation of the draws per output element (z > 5 has probability < 6e-7 each).
    The nearest-rounding result must fall outside that band somewhere (the test has power)."""
    n = 600
    a, b = _operands((4, 64), (64, 3), seed=16)
    exact = a.double() @ b.double()
    gen = _gen(17)
    draws = torch.stack([homomorphic_matmul(a, b, 32, 8, 2, rounding="stochastic", generator=gen).double()
                         for _ in range(n)])
    mean, sd = draws.mean(0), draws.std(0)
    tol = 5 * sd / math.sqrt(n)
    assert bool(((mean - exact).abs() <= tol).all()), float(((mean - exact).abs() / sd * math.sqrt(n)).max())
    nearest = homomorphic_matmul(a, b, 32, 8, 2).double()
    assert bool(((nearest - exact).abs() > tol).any())


def test_stochastic_reproducible_and_identity_holds_per_draw():
    a, b = _operands((4, 64), (64, 3), seed=18)
    x = homomorphic_matmul(a, b, 32, rounding="stochastic", generator=_gen(5))
    y = homomorphic_matmul(a, b, 32, rounding="stochastic", generator=_gen(5))
    z = homomorphic_matmul(a, b, 32, rounding="stochastic", generator=_gen(6))
    assert torch.equal(x, y) and not torch.equal(x, z)
    # The same draw, reproduced with the documented call order (A first, then B).
    gen = _gen(5)
    qa = quantize(a, 8, dim=-1, group_size=32, rounding="stochastic", generator=gen)
    qb = quantize(b, 2, dim=-2, group_size=32, rounding="stochastic", generator=gen)
    da, db = dequantize(qa, torch.float64), dequantize(qb, torch.float64)
    assert bool(((x.double() - da @ db).abs() <= RTOL * (da.abs() @ db.abs())).all())


def test_zero_range_groups():
    """Constant groups (scale 1) go through the same formula."""
    a = torch.full((2, 32), 0.5)
    a[1, 16:] = torch.linspace(-1, 1, 16)
    b = torch.full((32, 3), -2.0)
    b[:16, 1] = torch.linspace(0, 3, 16)
    ref, mag, _, _ = _dequant_product(a, b, 16, 8, 2)
    got = homomorphic_matmul(a, b, 16)
    assert bool(((got.double() - ref).abs() <= RTOL * mag).all())
    assert torch.allclose(got[0, 0], torch.tensor(0.5 * -2.0 * 32))


@pytest.mark.parametrize(
    "a_shape,b_shape",
    [((4, 64), (32, 4)), ((64,), (64, 4)), ((4, 64), (64,)), ((2, 4, 64), (2, 63, 4))],
)
def test_shapes_that_do_not_multiply(a_shape, b_shape):
    with pytest.raises(ValueError, match="shapes do not multiply"):
        homomorphic_matmul(torch.randn(a_shape), torch.randn(b_shape), 16)


def test_group_size_must_divide_inner_dim():
    with pytest.raises(ValueError, match="group_size"):
        homomorphic_matmul(torch.randn(4, 48), torch.randn(48, 4), 32)


def test_integer_operands_rejected():
    with pytest.raises(ValueError, match="floating-point"):
        homomorphic_matmul(torch.ones(4, 32, dtype=torch.int32), torch.randn(32, 4), 16)


def test_nan_operand_rejected():
    a = torch.randn(4, 32)
    a[2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        homomorphic_matmul(a, torch.randn(32, 4), 16)


def test_q_operands_validated():
    a, b = _operands((3, 64), (64, 4), seed=19)
    qa = quantize(a, 8, dim=-1, group_size=32)
    with pytest.raises(ValueError, match="group sizes differ"):
        homomorphic_matmul_q(qa, quantize(b, 2, dim=-2, group_size=16))
    with pytest.raises(ValueError, match="grouped along"):
        homomorphic_matmul_q(qa, quantize(b.t().contiguous(), 2, dim=-1, group_size=32))
    with pytest.raises(ValueError, match="grouped along"):
        homomorphic_matmul_q(quantize(a.t().contiguous(), 8, dim=-2, group_size=32),
                             quantize(b, 2, dim=-2, group_size=32))
