"""The CUDA decode kernel's fragment layout (hack_ops.cuda.fragment), on the CPU: the operand maps
are bijections whose MMA products equal the plain ones, the fragment code order packs and
unpacks exactly, and pages written by the reference quantizer convert to it and back bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig
from hack_ops.cuda.fragment import (PAGE, CodeOrder, PageTensor, convert_pages, fragment_permutation, k_operand,
                                    out_channels, pack_fragment, q_channels, to_fragment, to_token, unpack_fragment,
                                    v_operand)
from hack_ops.layout import page_layout
from hack_ops.packing import pack, unpack
from hack_ops.quant import quantize

DIMS = (64, 128, 256)


def _tile_from_registers(op: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Rebuild each 16x16 A tile from the registers' (token, channel) and a [tokens, channels]
    value table, by the fragment rule: lane 4g + t, register r, half h -> row g + 8(r % 2),
    contraction index 2t + h + 8(r // 2). op: [tiles..., 32, 4, 2, 2]."""
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    r = torch.arange(4)
    h = torch.arange(2)
    row = (g[:, None, None] + 8 * (r[None, :, None] % 2)).expand(32, 4, 2)
    kap = (2 * t[:, None, None] + h[None, None, :] + 8 * (r[None, :, None] // 2)).expand(32, 4, 2)
    lead = op.shape[:-4]
    tile = torch.zeros(*lead, 16, 16, dtype=values.dtype)
    vals = values[op[..., 0], op[..., 1]]  # [..., 32, 4, 2]
    tile[..., row, kap] = vals
    return tile


@pytest.mark.parametrize("d", DIMS)
def test_channel_map_is_a_permutation_within_each_lane_slice(d):
    ch = q_channels(d)  # [D/16, 16]
    assert sorted(ch.flatten().tolist()) == list(range(d))
    kappa = torch.arange(16)
    lane_t = (kappa % 8) // 2
    assert ((ch // (d // 4)) == lane_t[None, :]).all()  # lane t reads only its slice of D/4 channels


@pytest.mark.parametrize("d", DIMS)
def test_scores_through_the_fragments_equal_the_plain_product(d):
    """Sᵀ = K·Q'ᵀ tile by tile from the registers' contents (A from k_operand, B from the same
    channel map) equals codes @ Q'ᵀ exactly (integers)."""
    g = torch.Generator().manual_seed(d)
    codes = torch.randint(0, 4, (PAGE, d), generator=g)
    qp = torch.randint(-50, 50, (8, d), generator=g)  # 8 query heads: the MMA's N
    op = k_operand(d)  # [4, 32, D/16, 4, 2, 2]
    assert sorted((op[..., 0] * d + op[..., 1]).flatten().tolist()) == list(range(PAGE * d))
    a = _tile_from_registers(op.permute(0, 2, 1, 3, 4, 5), codes)  # [mt, kk, 16, 16]
    chan = q_channels(d)  # [kk, 16]
    b = qp[:, chan].permute(1, 2, 0)  # [kk, κ, n]
    st = torch.einsum("mkrc,kcn->mrn", a, b).reshape(PAGE, 8)
    assert torch.equal(st, codes @ qp.T)
    # the tokens of m-tile mt are 16mt .. 16mt + 15 in row order
    assert torch.equal(op[:, :, :, :, 0, 0].reshape(4, -1).min(1).values, torch.arange(4) * 16)


@pytest.mark.parametrize("d", DIMS)
def test_values_through_the_fragments_equal_the_plain_product(d):
    """Oᵀ = Vᵀ·P'ᵀ with P' scaled per head_dim group (each m-tile lies in one group) equals the
    plain per-group product, and the output map names every (channel, query head) once."""
    gen = torch.Generator().manual_seed(d + 1)
    codes = torch.randint(0, 4, (PAGE, d), generator=gen)
    ng = d // 64
    pp = torch.randint(0, 100, (ng, 8, PAGE), generator=gen)  # P' of each group [grp, n, token]
    op = v_operand(d)  # [kt, 32, md, 4, 2, 2]
    assert sorted((op[..., 0] * d + op[..., 1]).flatten().tolist()) == list(range(PAGE * d))
    assert ((op[..., 1] // 64) == (torch.arange(d // 16) // 4)[None, None, :, None, None]).all()
    a = _tile_from_registers(op.permute(0, 2, 1, 3, 4, 5), codes)  # [kt, md, 16 rows, 16 tokens]
    md = torch.arange(d // 16)
    b = pp[md // 4].reshape(d // 16, 8, 4, 16).permute(2, 0, 3, 1)  # [kt, md, κ, n]
    ot = torch.einsum("kmrc,kmcn->mrn", a, b)  # [md, row, n]
    oc = out_channels(d)  # [md, 32, 4, (channel, qh)]
    assert sorted((oc[..., 0] * 8 + oc[..., 1]).flatten().tolist()) == list(range(d * 8))
    lane = torch.arange(32)
    e = torch.arange(4)
    rows = (lane[:, None] // 4 + 8 * (e[None, :] // 2)).expand(32, 4)
    qh = (2 * (lane[:, None] % 4) + e[None, :] % 2).expand(32, 4)
    got = torch.zeros(d, 8, dtype=torch.long)
    for m in range(d // 16):
        got[oc[m, ..., 0], oc[m, ..., 1]] = ot[m][rows, qh]
    want = torch.stack([pp[c // 64] @ codes[:, c] for c in range(d)])  # [D, n]
    assert torch.equal(got, want)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("tensor", list(PageTensor))
def test_pack_and_unpack_agree_with_the_byte_permutation(d, tensor):
    gen = torch.Generator().manual_seed(d)
    codes = torch.randint(0, 4, (PAGE, d), generator=gen, dtype=torch.uint8)
    token_bytes = pack(codes, 2)  # layout v2's order
    frag = pack_fragment(codes, tensor)
    assert torch.equal(frag, to_fragment(token_bytes, d, tensor))  # two constructions, one answer
    assert torch.equal(unpack_fragment(frag, tensor), codes)
    assert torch.equal(to_token(frag, d, tensor), token_bytes)
    perm = fragment_permutation(d, tensor)
    assert sorted(perm.tolist()) == list(range(PAGE * d // 4))


def test_fragment_order_gives_each_lane_16_byte_vectors():
    """Head_dim 128: a lane's K bytes of one m-tile (rows g, g + 8) and its V bytes of one k-tile
    (two token pairs x two groups) are one 16-byte vector at (tile·32 + lane)·16."""
    d = 128
    for tensor, op in ((PageTensor.K, k_operand(d)), (PageTensor.V, v_operand(d))):
        perm = fragment_permutation(d, tensor).reshape(4, 32, 16)  # [tile, lane, byte]
        row = d // 4
        tokens = perm // row
        want = op[..., 0].reshape(4, 32, -1)
        for tile in range(4):
            for lane in range(32):
                assert set(tokens[tile, lane].tolist()) == set(want[tile, lane].tolist())


@pytest.mark.parametrize("d", [64, 128])
def test_pages_written_by_the_reference_convert_exactly(d):
    """The page writer: reference-quantized pages (hack_ops.triton.testing.fill_sequence, i.e.
    hack_ops.quantize + packing) converted to fragment order hold, per head, exactly the codes of
    hack_ops.quantize; the side tables do not move; converting back restores every byte."""
    from hack_ops.triton.store import new_buffers
    from hack_ops.triton.testing import fill_sequence

    cfg = HackConfig(sink_tokens=2)
    heads = 2
    lay = page_layout(cfg, heads, d)
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(3 * PAGE + 5, heads, d, generator=gen).half().float()
    v = torch.randn(3 * PAGE + 5, heads, d, generator=gen).half().float()
    bufs = new_buffers(lay, 5, 1, 5)
    pages = [3, 0, 4, 1]
    fill_sequence(lay, bufs, k, v, pages, 0, pages[0])
    before_k, before_v = bufs["k_buf"].clone(), bufs["v_buf"].clone()
    closed = torch.tensor(pages[:3])
    convert_pages(lay, bufs["k_buf"], bufs["v_buf"], CodeOrder.FRAGMENT, closed)
    sink = (torch.arange(PAGE) < cfg.sink_tokens)[:, None, None]
    for i, page in enumerate(pages[:3]):
        lo = i * PAGE
        mask = ~sink.expand(PAGE, heads, d) if i == 0 else None
        qk = quantize(k[lo:lo + PAGE], 2, dim=0, group_size=PAGE, meta_dtype=torch.float16, mask=mask, range_search=True)
        qv = quantize(v[lo:lo + PAGE], 2, dim=-1, group_size=64, meta_dtype=torch.float16, range_search=True)
        vcodes = qv.codes.masked_fill(sink, 0) if i == 0 else qv.codes
        for hd in range(heads):
            kf = lay.k.view(bufs["k_buf"], "codes")[page, hd]
            vf = lay.v.view(bufs["v_buf"], "codes")[page, hd]
            assert torch.equal(unpack_fragment(kf, "k"), qk.codes[:, hd])
            assert torch.equal(unpack_fragment(vf, "v"), vcodes[:, hd])
        for name in ("minimum", "scale", "sums"):
            assert torch.equal(lay.k.view(bufs["k_buf"], name)[page], lay.k.view(before_k, name)[page])
    assert torch.equal(bufs["k_buf"][pages[3]], before_k[pages[3]])  # the open page was not touched
    convert_pages(lay, bufs["k_buf"], bufs["v_buf"], CodeOrder.TOKEN, closed)
    assert torch.equal(bufs["k_buf"], before_k) and torch.equal(bufs["v_buf"], before_v)
    assert torch.equal(unpack(lay.k.view(before_k, "codes")[pages[1], 0], 2, d),
                       unpack_fragment(to_fragment(lay.k.view(before_k, "codes")[pages[1], 0], d, "k"), "k"))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="head_dim"):
        q_channels(96)
    with pytest.raises(ValueError, match="uint8"):
        to_fragment(torch.zeros(PAGE, 31, dtype=torch.uint8), 128, "k")
    with pytest.raises(ValueError, match="uint8"):
        pack_fragment(torch.zeros(32, 128, dtype=torch.uint8), "k")
