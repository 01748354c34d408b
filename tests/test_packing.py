"""pack / unpack: lossless round trips for 2, 4 and 8 bits, the documented bit order
(little-endian within a byte), padding of a ragged last dim, and the error paths."""
from __future__ import annotations

import pytest
import torch

from hack_ops import pack, quantize, unpack


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _codes(shape, bits, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**bits, shape, generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", [(1,), (3,), (4,), (7,), (64,), (5, 64), (2, 3, 17), (2, 4, 16, 33), (3, 0)])
def test_round_trip(bits, shape):
    c = _codes(shape, bits, seed=sum(shape) + bits)
    p = pack(c, bits)
    k = 8 // bits
    assert p.dtype == torch.uint8
    assert p.shape == (*shape[:-1], -(-shape[-1] // k))
    u = unpack(p, bits, shape[-1])
    assert u.dtype == torch.uint8 and torch.equal(u, c)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_every_code_value_round_trips(bits):
    k = 8 // bits
    # All combinations of 2**bits codes in the first two slots of a byte.
    a, b = torch.meshgrid(torch.arange(2**bits), torch.arange(2**bits), indexing="ij")
    c = torch.zeros(a.numel(), max(k, 2), dtype=torch.uint8)
    c[:, 0], c[:, 1] = a.flatten().to(torch.uint8), b.flatten().to(torch.uint8)
    assert torch.equal(unpack(pack(c, bits), bits, c.shape[-1]), c)


def test_documented_bit_order_2bit():
    """c0 | c1 << 2 | c2 << 4 | c3 << 6."""
    c = torch.tensor([[1, 2, 3, 0, 3, 3, 3, 3, 0, 0, 0, 1]], dtype=torch.uint8)
    p = pack(c, 2)
    assert p.tolist() == [[1 | 2 << 2 | 3 << 4 | 0 << 6, 0xFF, 1 << 6]]
    assert p.tolist() == [[0b00111001, 0b11111111, 0b01000000]]


def test_documented_bit_order_4bit_and_8bit():
    c = torch.tensor([0x3, 0xA, 0xF, 0x0, 0x1], dtype=torch.uint8)
    assert pack(c, 4).tolist() == [0xA3, 0x0F, 0x01]  # low nibble first, ragged tail padded with 0
    c8 = torch.tensor([0, 7, 255, 128], dtype=torch.uint8)
    p8 = pack(c8, 8)
    assert torch.equal(p8, c8)
    p8[0] = 9  # a copy, not a view of the input
    assert int(c8[0]) == 0


def test_padding_is_zero_codes():
    c = torch.tensor([3, 3, 3, 3, 3], dtype=torch.uint8)
    assert pack(c, 2).tolist() == [0xFF, 0x03]
    assert unpack(pack(c, 2), 2, 5).tolist() == [3] * 5
    # Unpacking the padded length exposes the zero pad codes.
    assert unpack(pack(c, 2), 2, 8).tolist() == [3] * 5 + [0] * 3


def test_pack_non_contiguous_input():
    c = _codes((16, 8), 2, seed=3).t()  # [8, 16], non-contiguous
    assert not c.is_contiguous()
    assert torch.equal(unpack(pack(c, 2), 2, 16), c)
    assert torch.equal(pack(c, 2), pack(c.contiguous(), 2))


@pytest.mark.parametrize("bits", [2, 4])
def test_packs_quantized_codes(bits):
    """The packed size of a page row of head_dim codes is head_dim * bits / 8 bytes."""
    x = torch.randn(3, 64, 64, generator=torch.Generator().manual_seed(4))
    qt = quantize(x, bits, dim=-2, group_size=64)
    p = pack(qt.codes, bits)
    assert p.shape == (3, 64, 64 * bits // 8)
    assert torch.equal(unpack(p, bits, 64), qt.codes)


@pytest.mark.parametrize("bits", [1, 3, 5, 16, 0])
def test_invalid_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        pack(torch.zeros(4, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match="bits"):
        unpack(torch.zeros(4, dtype=torch.uint8), bits, 4)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.float32])
def test_wrong_dtype(dtype):
    with pytest.raises(ValueError, match="uint8"):
        pack(torch.zeros(4, dtype=dtype), 2)
    with pytest.raises(ValueError, match="uint8"):
        unpack(torch.zeros(4, dtype=dtype), 2, 16)


@pytest.mark.parametrize("bits,bad", [(2, 4), (2, 255), (4, 16)])
def test_codes_out_of_range(bits, bad):
    c = torch.zeros(8, dtype=torch.uint8)
    c[5] = bad
    with pytest.raises(ValueError, match=f"{bits} bits"):
        pack(c, bits)


def test_zero_dim_codes():
    with pytest.raises(ValueError, match="dimension"):
        pack(torch.tensor(1, dtype=torch.uint8), 2)


@pytest.mark.parametrize("bits,nbytes,n", [(2, 2, 9), (2, 2, 4), (2, 2, -1), (4, 3, 7), (4, 3, 4),
                                           (8, 3, 2), (8, 3, 4)])
def test_unpack_length_must_match_packed_bytes(bits, nbytes, n):
    """n must need exactly the given number of bytes: more codes than fit, or so few that a
    whole byte would be padding, is an error."""
    with pytest.raises(ValueError, match="does not match"):
        unpack(torch.zeros(nbytes, dtype=torch.uint8), bits, n)


@pytest.mark.parametrize("bits,nbytes,n", [(2, 2, 5), (2, 2, 8), (4, 3, 5), (4, 3, 6), (8, 3, 3)])
def test_unpack_valid_lengths(bits, nbytes, n):
    assert unpack(torch.zeros(nbytes, dtype=torch.uint8), bits, n).shape == (n,)
