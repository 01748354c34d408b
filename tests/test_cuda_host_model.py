"""The CUDA decode kernel's per-thread arithmetic, compiled for the host from the same header the
kernel uses (hack_ops/cuda/csrc/hack_frag.cuh via hack_frag_host.cu), against the Python model
and the reference quantizer: the widening of packed codes to fp16 pairs, a page staged the way
the cp.async ring stages it (swizzle included) and read back as every lane's MMA fragments, the
pairs of K's side tables, which pages a split reads, and the argument struct's layout.
Needs nvcc (skipped with the reason where it is missing); no GPU.
"""
from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest
import torch

from hack_ops import HackConfig
from hack_ops.cuda.build import nvcc
from hack_ops.cuda.fragment import PAGE, CodeOrder, k_operand, q_channels, to_fragment, v_operand
from hack_ops.layout import page_layout

pytestmark = pytest.mark.skipif(nvcc() is None, reason="nvcc is not installed: the CUDA kernel's host model "
                                                        "cannot be built (install the CUDA toolkit or set NVCC)")
DIMS = (64, 128, 256)
ORDERS = {CodeOrder.TOKEN: 0, CodeOrder.FRAGMENT: 1}


@pytest.fixture(scope="module")
def lib():
    from hack_ops.cuda.build import host_library

    lib = ctypes.CDLL(str(host_library()))
    u8p = ctypes.POINTER(ctypes.c_uint8)
    u32p = ctypes.POINTER(ctypes.c_uint32)
    lib.hfh_code_pair.argtypes = [ctypes.c_uint32, ctypes.c_int]
    lib.hfh_code_pair.restype = ctypes.c_uint32
    lib.hfh_join_halves.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int]
    lib.hfh_join_halves.restype = ctypes.c_uint32
    lib.hfh_stage.argtypes = [ctypes.c_int, ctypes.c_int, *([u8p] * 7)]
    lib.hfh_k_frags.argtypes = lib.hfh_v_frags.argtypes = [ctypes.c_int, ctypes.c_int, u8p, ctypes.c_int, u32p]
    lib.hfh_table_pairs.argtypes = [ctypes.c_int, ctypes.c_int, u8p, ctypes.c_int, ctypes.c_int, u32p]
    lib.hfh_page_range.argtypes = [ctypes.c_int] * 5 + [ctypes.POINTER(ctypes.c_int32)]
    lib.hfh_geometry.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    lib.hfh_param_layout.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    return lib


def _ptr(a: np.ndarray, ctype=ctypes.c_uint8):
    return a.ctypes.data_as(ctypes.POINTER(ctype))


def _halves(words: np.ndarray) -> np.ndarray:
    """uint32 fp16 pairs -> float [..., 2] (low half first)."""
    return np.stack([(words & 0xFFFF).astype(np.uint16), (words >> 16).astype(np.uint16)], -1).view(np.float16).astype(np.float32)


def test_widening_gives_exact_codes_in_fragment_pairs(lib):
    """Pair i of a word is (code i, code i + 8) as exact fp16 values, for random words and the
    extremes (all zeros, all threes)."""
    rng = random.Random(0)
    words = [0, 0xFFFFFFFF, 0x55555555, 0xAAAAAAAA] + [rng.getrandbits(32) for _ in range(2000)]
    for w in words:
        codes = [(w >> (2 * j)) & 3 for j in range(16)]
        got = _halves(np.array([lib.hfh_code_pair(w, i) for i in range(8)], dtype=np.uint32))
        assert got.tolist() == [[float(codes[i]), float(codes[i + 8])] for i in range(8)], hex(w)


def test_join_halves_pairs_two_tokens(lib):
    a, b = 0x44332211, 0x88776655
    assert lib.hfh_join_halves(a, b, 0) == 0x66552211
    assert lib.hfh_join_halves(a, b, 1) == 0x88774433


def _page(d: int, seed: int):
    """One head's page sections from the reference quantizer (fill_sequence over random K/V)."""
    from hack_ops.triton.store import new_buffers
    from hack_ops.triton.testing import fill_sequence

    lay = page_layout(HackConfig(sink_tokens=0), 1, d)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(PAGE, 1, d, generator=gen).half().float() * (1 + torch.arange(d) % 5)
    v = torch.randn(PAGE, 1, d, generator=gen).half().float()
    bufs = new_buffers(lay, 1, 1, 1)
    fill_sequence(lay, bufs, k, v, [0], 0, 0)
    kb, vb = bufs["k_buf"], bufs["v_buf"]
    sec = {n: lay.k.view(kb, n)[0, 0] for n in ("codes", "minimum", "scale")}
    sec.update({"v_" + n: lay.v.view(vb, n)[0, 0] for n in ("codes", "minimum", "scale")})
    return lay, sec


def _stage(lib, d: int, order: CodeOrder, sec) -> np.ndarray:
    geo = (ctypes.c_int64 * 12)()
    assert lib.hfh_geometry(d, geo) == 0
    st = np.zeros(geo[0] + 16, dtype=np.uint8)
    st = st[(-st.ctypes.data) % 16:][: geo[0]]  # 16-byte aligned, as shared memory is
    kc, vc = sec["codes"], sec["v_codes"]
    if order == CodeOrder.FRAGMENT:
        kc, vc = to_fragment(kc, d, "k"), to_fragment(vc, d, "v")
    arrs = [np.ascontiguousarray(x.contiguous().view(torch.uint8).numpy()) for x in
            (kc, sec["minimum"], sec["scale"], vc, sec["v_minimum"], sec["v_scale"])]
    assert lib.hfh_stage(d, ORDERS[order], *[_ptr(a) for a in arrs], _ptr(st)) == 0
    return st


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("order", list(CodeOrder))
def test_every_lane_reads_its_fragments_from_a_staged_page(lib, d, order):
    """Stage a reference-quantized page as the ring does, read every lane's A fragments with the
    kernel's own functions: each fp16 is the code of the (token, channel) the Python model names,
    and K's side-table pairs are the scale/minimum of the channels the model pairs."""
    from hack_ops.packing import unpack

    lay, sec = _page(d, seed=d)
    st = _stage(lib, d, order, sec)
    kcodes = unpack(sec["codes"], 2, d).float().numpy()  # [Π, D] reference codes
    vcodes = unpack(sec["v_codes"], 2, d).float().numpy()
    kop, vop = k_operand(d).numpy(), v_operand(d).numpy()
    chan = q_channels(d).numpy()
    kscale = sec["scale"].float().numpy()
    kmin = sec["minimum"].float().numpy()
    md = d // 16
    out = np.zeros(4 * md * 4, dtype=np.uint32)
    pairs = np.zeros(d // 8, dtype=np.uint32)
    for lane in range(32):
        assert lib.hfh_k_frags(d, ORDERS[order], _ptr(st), lane, _ptr(out, ctypes.c_uint32)) == 0
        got = _halves(out.reshape(4, md, 4))  # [mt, kk, reg, half]
        op = kop[:, lane]  # [mt, kk, reg, half, 2]
        assert np.array_equal(got, kcodes[op[..., 0], op[..., 1]]), f"K lane {lane}"
        assert lib.hfh_v_frags(d, ORDERS[order], _ptr(st), lane, _ptr(out, ctypes.c_uint32)) == 0
        got = _halves(out.reshape(4, md, 4))  # [kt, md, reg, half]
        op = vop[:, lane]
        assert np.array_equal(got, vcodes[op[..., 0], op[..., 1]]), f"V lane {lane}"
        t = lane % 4
        for which, table in ((0, kscale), (1, kmin)):
            assert lib.hfh_table_pairs(d, ORDERS[order], _ptr(st), lane, which, _ptr(pairs, ctypes.c_uint32)) == 0
            got = _halves(pairs)  # [P, half]
            p = np.arange(d // 8)
            # pair P = 2kk + slot holds contraction indices 2t + h + 8·slot of k-tile kk
            want_ch = np.stack([chan[p // 2, 2 * t + 8 * (p % 2)], chan[p // 2, 2 * t + 1 + 8 * (p % 2)]], -1)
            assert np.array_equal(got, table[want_ch]), f"table {which} lane {lane}"


def _page_range_model(L, window, S, split, pps):
    """What a split reads, from first principles (hack_ops.attention's visibility)."""
    n_closed, r = divmod(L, PAGE)
    lo = max(L - 1 - window, 0) if window >= 0 else 0
    first = lo // PAGE + split * pps
    last = min(first + pps, -(-L // PAGE))
    closed_end = min(last, n_closed)
    return dict(lo=lo, pg_from=max(lo, S), first=first, last=last, closed_end=closed_end, n_closed=n_closed,
                open_len=r, has_open=int(r > 0 and first <= n_closed < last),
                has_sinks=int(split == 0 and S > 0 and lo < min(S, L)))


def test_page_ranges_cover_every_visible_page_once(lib):
    """Every key a query sees lies in exactly one split's pages (or the sinks), the warps of a split
    share its closed pages, and the numbers match the model above."""
    rng = random.Random(1)
    out = (ctypes.c_int32 * 13)()
    names = ("lo", "pg_from", "first", "last", "closed_end", "n_closed", "open_len", "has_open", "has_sinks")
    for _ in range(400):
        L = rng.randint(1, 40 * PAGE)
        window = rng.choice([-1, -1, 0, rng.randint(0, 5 * PAGE)])
        S = rng.choice([0, 1, 4])
        lo = max(L - 1 - window, 0) if window >= 0 else 0
        span = -(-L // PAGE) - lo // PAGE
        pps = rng.randint(1, max(1, span))
        splits = -(-span // pps)
        seen = []
        for split in range(splits):
            lib.hfh_page_range(L, window, S, split, pps, out)
            got = dict(zip(names, out[:9]))
            assert got == _page_range_model(L, window, S, split, pps)
            warps = list(out[9:13])
            assert sum(warps) == max(0, got["closed_end"] - got["first"])
            assert max(warps) - min(warps) <= 1
            seen += list(range(got["first"], got["last"]))
        assert seen == list(range(lo // PAGE, -(-L // PAGE)))


def test_the_argument_struct_matches_the_python_copy(lib):
    from hack_ops.cuda.launch import FIELDS, DecodeParams

    out = (ctypes.c_int64 * 64)()
    n = lib.hfh_param_layout(out)
    assert n == 1 + len(FIELDS)
    assert out[0] == ctypes.sizeof(DecodeParams)
    assert list(out[1:n]) == [getattr(DecodeParams, name).offset for name, _ in FIELDS]


@pytest.mark.parametrize("d", DIMS)
def test_shared_memory_fits_every_target(lib, d):
    """A block's rings fit the smallest per-block opt-in limit of the targets (sm86/sm89: 99 KB),
    and each staged page holds exactly one head's sections (plus the bank padding)."""
    geo = (ctypes.c_int64 * 12)()
    lib.hfh_geometry(d, geo)
    stage, smem, codes, tab, tabp, vtab = geo[0], geo[7], geo[8], geo[9], geo[10], geo[11]
    lay = page_layout(HackConfig(), 1, d)
    assert codes == lay.k.codes.nbytes == lay.v.codes.nbytes
    assert tab == lay.k.scale.nbytes and vtab == lay.v.scale.nbytes
    assert stage == 2 * codes + 2 * tabp + 2 * vtab and stage % 16 == 0
    assert smem == max(4 * 2 * stage, 4 * 8 * (d + 2) * 4) <= 101376
