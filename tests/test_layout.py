"""The HACK page layout: aligned, non-overlapping sections whose sizes add up to page_bytes,
typed views that round-trip through the opaque page bytes, and bytes-per-token accounting
checked against a hand calculation for SmolLM2-135M (3 KV heads, head_dim 64)."""
from __future__ import annotations

import json

import pytest
import torch

from hack_ops import HackConfig, pack, quantize, unpack
from hack_ops.layout import LAYOUT_VERSION, bytes_per_token, page_layout


pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIGS = [
    HackConfig(),
    HackConfig(partition_size=32),
    HackConfig(partition_size=16, sink_tokens=4),
    HackConfig(partition_size=128, kv_bits=4),
    HackConfig(partition_size=256, kv_bits=4, meta_dtype="float32"),
    HackConfig(orientation="token_k"),
    HackConfig(orientation="token_k", tail_tensors="per_channel", partition_size=32),
    HackConfig(orientation="channel_k", tail_tensors="per_channel", kv_bits=4, partition_size=48),
    HackConfig(partition_size=80, meta_dtype="float32", sink_tokens=0),
]
GEOMETRY = [(1, 16), (3, 64), (2, 128), (5, 80), (4, 8)]


def _sections(t):
    return [s for s in (t.codes, t.minimum, t.scale, t.sums) if s is not None]


def _elsize(dt):
    return torch.tensor([], dtype=dt).element_size()


@pytest.mark.parametrize(
    "cfg,heads,head_dim",
    [(c, h, d) for c in CONFIGS for h, d in GEOMETRY if d % c.head_group(d) == 0],
    ids=lambda x: x.label() if isinstance(x, HackConfig) else str(x),
)
def test_sections_aligned_ordered_and_sized(cfg, heads, head_dim):
    lay = page_layout(cfg, heads, head_dim)
    p, b = cfg.partition_size, cfg.kv_bits
    gd = min(p, head_dim)
    ng = head_dim // gd
    meta = torch.float16 if cfg.meta_dtype == "float16" else torch.float32
    for name, t in (("k", lay.k), ("v", lay.v)):
        secs = _sections(t)
        end = 0
        for s in secs:
            assert s.offset % 16 == 0, (name, s)
            assert s.offset >= end  # in order, no overlap
            assert s.offset - end < 16  # only alignment padding in between
            assert s.nbytes == _elsize(s.dtype) * int(torch.Size(s.shape).numel())
            end = s.offset + s.nbytes
        assert t.page_bytes == -(-end // 16) * 16  # ends aligned, nothing else in the page
        # Codes: [H, Π, D*bits/8] uint8.
        assert t.codes.shape == (heads, p, head_dim * b // 8) and t.codes.dtype == torch.uint8
        per_channel = not (cfg.k_per_token if name == "k" else cfg.v_per_token)
        assert t.per_channel is per_channel
        m = head_dim if per_channel else p * ng
        assert t.minimum.shape == t.scale.shape == (heads, m)
        assert t.minimum.dtype == t.scale.dtype == meta
    # K has sums per (token, head_dim group); V has none (P has a zero minimum).
    assert lay.k.sums.shape == (heads, p * ng)
    top = (2**cfg.kv_bits - 1) * gd
    assert torch.iinfo(lay.k.sums.dtype).max >= top
    assert lay.v.sums is None
    assert lay.page_bytes == lay.k.page_bytes + lay.v.page_bytes
    assert lay.page_bytes % 16 == 0


def test_default_page_bytes_by_hand():
    """SmolLM2: 3 KV heads, D = 64, Π = 64, 2 bits, fp16 meta.
    K (per channel): codes 3*64*16 = 3072, min 3*64*2 = 384, scale 384, sums 3*64*1 = 192 -> 4032.
    V (per token, groups of 64): codes 3072, min 3*64*2 = 384, scale 384 -> 3840."""
    lay = page_layout(HackConfig(), 3, 64)
    assert [(s.offset, s.nbytes) for s in _sections(lay.k)] == [(0, 3072), (3072, 384), (3456, 384), (3840, 192)]
    assert [(s.offset, s.nbytes) for s in _sections(lay.v)] == [(0, 3072), (3072, 384), (3456, 384)]
    assert (lay.k.page_bytes, lay.v.page_bytes, lay.page_bytes) == (4032, 3840, 7872)
    assert lay.bf16_page_bytes() == 2 * 2 * 64 * 3 * 64 == 49152
    assert lay.page_bytes / lay.bf16_page_bytes() == pytest.approx(0.16015625, abs=0)


@pytest.mark.parametrize(
    "p,heads,head_dim,k_offsets,k_bytes,v_bytes",
    [
        # 1 head, D = 16, Π = 16: codes 16*4 = 64, min 16*2 = 32, scale 32, sums 16 -> 144;
        # V: codes 64, min/scale per token 16*2 = 32 each -> 128.
        (16, 1, 16, [0, 64, 96, 128], 144, 128),
        # 3 heads, D = 8, Π = 16: codes 3*16*2 = 96, min 3*8*2 = 48, scale 48, sums 3*16 = 48.
        (16, 3, 8, [0, 96, 144, 192], 240, 96 + 96 + 96),
        # 1 head, D = 24, Π = 32 (groups of 24): codes 32*6 = 192, min 24*2 = 48, scale 48,
        # sums 32 -> 320; V: 192 + 32*2 + 32*2 = 320.
        (32, 1, 24, [0, 192, 240, 288], 320, 320),
        # 1 head, D = 4, Π = 16: codes 16, min 4*2 = 8 -> scale padded to 32 (not 24), sums to
        # 48 (not 40), K page 64; V: codes 16, min 32, scale 32 -> 80.
        (16, 1, 4, [0, 16, 32, 48], 64, 80),
    ],
)
def test_offsets_by_hand_with_padding(p, heads, head_dim, k_offsets, k_bytes, v_bytes):
    lay = page_layout(HackConfig(partition_size=p, sink_tokens=0), heads, head_dim)
    assert [s.offset for s in _sections(lay.k)] == k_offsets
    assert (lay.k.page_bytes, lay.v.page_bytes) == (k_bytes, v_bytes)


def _fill_page(lay, which, heads, head_dim, seed, pages=3):
    """Quantize random K or V for `pages` pages the documented way and write them through the views."""
    cfg = lay.config
    p, b = cfg.partition_size, cfg.kv_bits
    gd = cfg.head_group(head_dim)
    t = getattr(lay, which)
    buf = torch.zeros(pages, t.page_bytes, dtype=torch.uint8)
    x = torch.randn(pages, heads, p, head_dim, generator=torch.Generator().manual_seed(seed))
    meta = torch.float16 if cfg.meta_dtype == "float16" else torch.float32
    if t.per_channel:
        qt = quantize(x, b, dim=-2, group_size=p, meta_dtype=meta)  # [pages, H, 1, D]
        mins, scales = qt.minimum.squeeze(-2), qt.scale.squeeze(-2)
    else:
        qt = quantize(x, b, dim=-1, group_size=gd, meta_dtype=meta)  # [pages, H, Π, ng]
        mins, scales = qt.minimum.flatten(-2), qt.scale.flatten(-2)
    t.view(buf, "codes").copy_(pack(qt.codes, b))
    t.view(buf, "minimum").copy_(mins)
    t.view(buf, "scale").copy_(scales)
    sums = None
    if t.sums is not None:
        sums = qt.codes.reshape(pages, heads, p, head_dim // gd, gd).sum(-1, dtype=torch.int32).flatten(-2)
        t.view(buf, "sums").copy_(sums.to(t.sums.dtype))
    return buf, qt, mins, scales, sums


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize("which", ["k", "v"])
def test_views_round_trip_through_opaque_bytes(cfg, which):
    heads = 2
    head_dim = 64 if 64 % cfg.head_group(64) == 0 else 96
    lay = page_layout(cfg, heads, head_dim)
    buf, qt, mins, scales, sums = _fill_page(lay, which, heads, head_dim, seed=2 * CONFIGS.index(cfg) + (which == "v"))
    t = getattr(lay, which)
    # Move the pages as opaque bytes (what the transfer engine does), in another order.
    moved = torch.empty_like(buf)
    moved[[2, 0, 1]] = buf
    perm = [2, 0, 1]  # moved[perm[i]] holds original page i
    got_codes = unpack(t.view(moved, "codes"), cfg.kv_bits, head_dim)[perm]
    assert torch.equal(got_codes, qt.codes)
    assert torch.equal(t.view(moved, "minimum")[perm], mins)
    assert torch.equal(t.view(moved, "scale")[perm], scales)
    if sums is not None:
        assert torch.equal(t.view(moved, "sums")[perm].to(torch.int32), sums)
    else:
        with pytest.raises(ValueError, match="no 'sums' section"):
            t.view(moved, "sums")


def test_views_are_disjoint_and_write_through():
    lay = page_layout(HackConfig(partition_size=32, sink_tokens=4), 3, 64)
    t = lay.k
    buf = torch.zeros(4, t.page_bytes, dtype=torch.uint8)
    written = torch.zeros_like(buf, dtype=torch.bool)
    for name in ("codes", "minimum", "scale", "sums"):
        before = buf.clone()
        v = t.view(buf, name)
        assert v.shape == (4, *getattr(t, name).shape) and v.dtype == getattr(t, name).dtype
        v.fill_(3)  # through the view, into buf
        changed = buf != before
        sec = getattr(t, name)
        assert bool(changed[:, sec.offset:sec.offset + sec.nbytes].all()) or name != "codes"
        assert not bool(changed[:, :sec.offset].any()) and not bool(changed[:, sec.offset + sec.nbytes:].any())
        assert not bool((written & changed).any())  # no two sections share a byte
        written |= changed
    assert torch.equal(t.view(buf, "scale").float(), torch.full((4, 3, 64), 3.0))
    assert torch.equal(t.view(buf, "sums").long(), torch.full((4, 3, 32 * 2), 3))


def test_tail_sink_shapes_and_describe():
    lay = page_layout(HackConfig(partition_size=32, sink_tokens=4), 3, 64)
    assert lay.page_size == 32
    assert lay.tail_shape() == (32, 3, 64)
    assert lay.sink_shape() == (4, 3, 64)
    assert lay.tail_tensors == ("k", "v")
    assert page_layout(HackConfig(orientation="token_k", tail_tensors="per_channel"), 3, 64).tail_tensors == ("v",)
    assert page_layout(HackConfig(tail_tensors="per_channel"), 3, 64).tail_tensors == ("k",)
    d = lay.describe()
    assert json.loads(json.dumps(d)) == d
    assert d["version"] == LAYOUT_VERSION == 2
    assert d["k_page_bytes"] == lay.k.page_bytes and d["v_page_bytes"] == lay.v.page_bytes
    assert (d["partition_size"], d["num_heads"], d["head_dim"], d["sink_tokens"]) == (32, 3, 64, 4)
    assert d["tail_tensors"] == ["k", "v"]
    # Two sides that disagree on anything that changes the bytes describe differently.
    assert page_layout(HackConfig(partition_size=64), 3, 64).describe() != page_layout(HackConfig(), 3, 32).describe()
    assert page_layout(HackConfig(kv_bits=4), 3, 64).describe() != page_layout(HackConfig(), 3, 64).describe()


@pytest.mark.parametrize("heads,head_dim,p", [(0, 64, 64), (3, 0, 64), (-1, 64, 64), (3, 48, 32), (3, 96, 64),
                                              (1, 2, 16)])
def test_invalid_geometry(heads, head_dim, p):
    with pytest.raises(ValueError):
        page_layout(HackConfig(partition_size=p, sink_tokens=0), heads, head_dim)


def _hand_bytes_per_token(context: int) -> float:
    """Independent hand calculation for SmolLM2 (3 KV heads, D = 64) with the default config
    (Π = 64, 2 bits, fp16 meta, K per channel with per-token sums, V per token, FP16 tails for
    K and V, 1 sink). Averaged over the open partition holding r = 0..63 tokens: the request
    holds ceil((context + r) / 64) pages, r FP16 tail tokens of K and of V, and 1 FP16 sink
    token of K and of V."""
    k_page = 3 * (64 * 64 * 2 // 8) + 3 * 64 * 2 * 2 + 3 * 64 * 1  # codes + min/scale + sums
    v_page = 3 * (64 * 64 * 2 // 8) + 3 * 64 * 2 * 2
    page = k_page + v_page  # 7872
    fp16_token = 3 * 64 * 2  # one tensor, one token, all heads
    total = 0.0
    for r in range(64):
        n = context + r
        pages = (n + 63) // 64
        total += (pages * page + 2 * r * fp16_token + 2 * 1 * fp16_token) / n
    return total / 64


def test_bytes_per_token_smollm2_default_at_2k():
    lay = page_layout(HackConfig(), 3, 64)
    got = bytes_per_token(lay, 2048)
    bf16 = 2 * 3 * 64 * 2  # K and V, BF16
    assert got["bf16_bytes_per_token"] == bf16 == 768
    assert got["bytes_per_token"] == pytest.approx(_hand_bytes_per_token(2048), rel=1e-12)
    assert got["ratio"] == pytest.approx(_hand_bytes_per_token(2048) / 768, rel=1e-12)
    assert got["ratio"] == pytest.approx(0.178145, abs=5e-6)  # ~17.8% of BF16


def test_bytes_per_token_trends():
    lay = page_layout(HackConfig(), 3, 64)
    contexts = (256, 1024, 2048, 8192, 65536)
    r = [bytes_per_token(lay, c)["ratio"] for c in contexts]
    for c, got in zip(contexts, r):
        assert got == pytest.approx(_hand_bytes_per_token(c) / 768, rel=1e-12)
    assert all(a > b for a, b in zip(r, r[1:]))  # the per-request constant amortizes
    assert 7872 / 49152 < r[-1] < 7872 / 49152 * 1.01  # -> full pages only (16.0%)
    assert r[-1] > 0.125  # never below the 2-bit code floor
    # Full partition, no tail: exactly pages + sinks.
    exact = bytes_per_token(lay, 2048, tail_fill=0)
    assert exact["bytes_per_token"] == (32 * 7872 + 2 * 384) / 2048
    half = bytes_per_token(lay, 2048, tail_fill=32)
    assert half["bytes_per_token"] == (33 * 7872 + 2 * 32 * 384 + 2 * 384) / 2080
    # Fewer tails or no sinks cost less; 4-bit codes cost more.
    base = bytes_per_token(lay, 2048)["bytes_per_token"]
    assert bytes_per_token(page_layout(HackConfig(tail_tensors="per_channel"), 3, 64), 2048)["bytes_per_token"] < base
    no_sink = bytes_per_token(page_layout(HackConfig(sink_tokens=0), 3, 64), 2048)["bytes_per_token"]
    assert no_sink == pytest.approx(base - 2 * 384 * _mean_inv(2048), rel=1e-12)  # K and V sink token
    assert bytes_per_token(page_layout(HackConfig(kv_bits=4), 3, 64), 2048)["ratio"] > 0.29


def _mean_inv(context: int) -> float:
    """Mean of 1/(context + r) over r = 0..63 (the sink bytes are spread over n tokens)."""
    return sum(1 / (context + r) for r in range(64)) / 64
