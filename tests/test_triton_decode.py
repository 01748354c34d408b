"""Triton decode attention against hack_ops.attention, on the kernel device (tests/conftest.py:
a CUDA GPU when present, else TRITON_INTERPRET=1 on CPU tensors); the reference runs on the CPU.

Pages are filled by hack_ops.triton.testing.fill_sequence (hack_ops.quantize + the layout's
section views), so these tests check the attention kernel on its own; the store kernel has
its own tests. Tolerances: hack_ops.triton.testing (TOL_*), stated and argued there.
"""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig
from hack_ops.layout import page_layout
from hack_ops.triton.decode import HackDecodeAttention
from hack_ops.triton.store import cache_kwargs
from hack_ops.triton.testing import (assert_matches_reference, dense_reference, per_head_reference, per_head_selection,
                                     random_batch, require_kernel_device)

KV_HEADS = 2


@pytest.fixture(autouse=True, scope="module")
def _kernel_device(kernel_device):
    require_kernel_device(kernel_device)  # a GPU, or Triton's interpreter on CPU tensors


def _run_decode(device, cfg: HackConfig, head_dim: int, rep: int, lens: list[int], seed: int = 0,
                kv_heads: int = KV_HEADS, features: dict | None = None, poison=None, **kw):
    """Inputs built on the CPU, the kernel on `device`; out, q and the reference come back on the CPU.
    features: the layer's window / logit_cap (run() and the reference) and scale (sm_scale);
    poison(layout, batch): spoils cache entries the kernel must not read, before it runs."""
    feats = dict(features or {})
    scale = feats.pop("scale", None)
    lay = page_layout(cfg, kv_heads, head_dim)
    b = random_batch(lay, lens, [0] * len(lens), kv_heads * rep, seed=seed, device=device)
    if poison is not None:
        poison(lay, b)
    q = torch.randn(len(lens), kv_heads * rep, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    att = HackDecodeAttention(lay, kv_heads * rep, sm_scale=scale, **kw)
    att.plan(b["kv_indptr"], b["kv_indices"], b["seq_lens"], b["tail_rows"], b["sink_slots"])
    out = att.run(q.to(device), **cache_kwargs(b["bufs"]), out=torch.empty(q.shape, device=device), **feats).cpu()
    refs = [dense_reference(q[i:i + 1], b["k"][i], b["v"][i], lay, scale=scale, **feats)[0] for i in range(len(lens))]
    return out, torch.stack(refs), b, att, q, lay


@pytest.mark.parametrize("page", [32, 64, pytest.param(128, marks=pytest.mark.slow)])
def test_every_tail_length(kernel_device, page):
    """One request per open-partition fill 0..Π-1, behind one or two closed pages, GQA 4."""
    lens = [(1 + r % 2) * page + r for r in range(page)]
    out, ref, *_ = _run_decode(kernel_device, HackConfig(partition_size=page, range_search=False), 64, 4, lens)
    assert_matches_reference(out, ref, f"Π={page}")


@pytest.mark.parametrize("page,head_dim,rep,sinks", [
    (32, 256, 1, 1),
    (64, 128, 3, 4),
    (128, 64, 4, 1),
    (64, 64, 1, 0),
    pytest.param(128, 256, 3, 2, marks=pytest.mark.slow),
])
def test_shapes_and_mixed_lengths(kernel_device, page, head_dim, rep, sinks):
    cfg = HackConfig(partition_size=page, sink_tokens=sinks)
    lens = [1, sinks + 1, page - 1, page, page + 1, 3 * page + 5]
    out, ref, *_ = _run_decode(kernel_device, cfg, head_dim, rep, lens, seed=page + head_dim)
    assert_matches_reference(out, ref, f"Π={page} D={head_dim} rep={rep}")


def test_kernel_is_not_trivially_close(kernel_device):
    """The tolerance separates HACK from exact attention: the reference modes differ by far more."""
    cfg = HackConfig(partition_size=32)
    out, ref, b, att, q, lay = _run_decode(kernel_device, cfg, 64, 2, [100, 70])
    exact = torch.stack([dense_reference(q[i:i + 1], b["k"][i], b["v"][i], lay, mode="exact")[0] for i in range(2)])
    assert (exact - ref).abs().max() > 10 * (out - ref).abs().max() + 0.05


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_split_sequence_combines(kernel_device, splits):
    """Flash-decoding: any split of the pages gives the same result as one pass."""
    cfg = HackConfig(partition_size=32, sink_tokens=2)
    out, ref, *_ = _run_decode(kernel_device, cfg, 64, 3, [7, 32, 97, 200], num_splits=splits)
    assert_matches_reference(out, ref, f"splits={splits}")


def test_format_options(kernel_device):
    """V quantized as written (tail_tensors='per_channel'), 4-bit codes, fp32 side tables."""
    for cfg in (HackConfig(partition_size=64, tail_tensors="per_channel", sink_tokens=3),
                HackConfig(partition_size=32, kv_bits=4, meta_dtype="float32", range_search=False)):
        out, ref, *_ = _run_decode(kernel_device, cfg, 64, 2, [5, 64, 90])
        assert_matches_reference(out, ref, cfg.label())


@pytest.mark.parametrize("cfg", [
    HackConfig(partition_size=32, k_bits=4, sink_tokens=2),  # K 4-bit, V 2-bit
    HackConfig(partition_size=32, kv_bits=4, k_bits=2, tail_tensors="per_channel"),  # K 2-bit, V 4-bit (open page too)
], ids=["K4V2", "K2V4"])
def test_split_bits(kernel_device, cfg):
    """K and V codes with their own bits (HackConfig.k_bits), closed pages and open partitions."""
    out, ref, *_ = _run_decode(kernel_device, cfg, 64, 2, [5, 32, 90], num_splits=2)
    assert_matches_reference(out, ref, cfg.label())


def test_fp16_mma_fallback_is_identical(kernel_device):
    """The V100 path (integer products through fp16 MMA) gives the same numbers as INT8 MMA."""
    cfg = HackConfig(partition_size=32)
    a, *_ = _run_decode(kernel_device, cfg, 64, 2, [40, 100], dot_f16=False)
    b, *_ = _run_decode(kernel_device, cfg, 64, 2, [40, 100], dot_f16=True)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_bf16_in_and_out(kernel_device):
    cfg = HackConfig(partition_size=32)
    lay = page_layout(cfg, KV_HEADS, 64)
    b = random_batch(lay, [50, 9], [0, 0], 4, device=kernel_device)
    q = torch.randn(2, 4, 64).to(torch.bfloat16)
    att = HackDecodeAttention(lay, 4)
    att.plan(b["kv_indptr"], b["kv_indices"], b["seq_lens"], b["tail_rows"], b["sink_slots"])
    out = att.run(q.to(kernel_device), **cache_kwargs(b["bufs"])).cpu()
    assert out.dtype == torch.bfloat16
    ref = torch.stack([dense_reference(q[i:i + 1], b["k"][i], b["v"][i], lay)[0] for i in range(2)])
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)  # bf16 output rounding


def test_bad_input_is_refused(kernel_device):
    lay = page_layout(HackConfig(partition_size=32), KV_HEADS, 64)
    b = random_batch(lay, [40], [0], 2, device=kernel_device)
    with pytest.raises(ValueError, match="multiple"):
        HackDecodeAttention(lay, 3)
    att = HackDecodeAttention(lay, 2)
    with pytest.raises(RuntimeError, match="plan"):
        att.run(torch.zeros(1, 2, 64, device=kernel_device), **cache_kwargs(b["bufs"]))
    with pytest.raises(ValueError, match="pages for"):
        att.plan(b["kv_indptr"], b["kv_indices"], torch.tensor([200], device=kernel_device))
    att.plan(b["kv_indptr"], b["kv_indices"], b["seq_lens"], b["tail_rows"], b["sink_slots"])
    with pytest.raises(ValueError, match="q must be"):
        att.run(torch.zeros(1, 4, 64, device=kernel_device), **cache_kwargs(b["bufs"]))
    kw = cache_kwargs(b["bufs"])
    kw["tail_v"] = None
    with pytest.raises(ValueError, match="tail_v"):
        att.run(torch.zeros(1, 2, 64, device=kernel_device), **kw)
    kw = cache_kwargs(b["bufs"])
    kw["k_buf"] = kw["k_buf"][:, :-16]
    with pytest.raises(ValueError, match="k_buf"):
        att.run(torch.zeros(1, 2, 64, device=kernel_device), **kw)
    for cfg in (HackConfig(orientation="token_k"), HackConfig(requant_elimination=False),
                HackConfig(rounding="stochastic"), HackConfig(partition_size=16), HackConfig(partition_size=48)):
        with pytest.raises(NotImplementedError):
            HackDecodeAttention(page_layout(cfg, KV_HEADS, 48 if cfg.partition_size == 48 else 64), 2)


# Sliding windows (hack_ops.attention's `window`: keys t-window..t) against the page size 32:
# inside one page, spanning pages off the page grid, wider than every context; with sinks that
# drop out of the window for the longer requests. Soft-cap on and off, a non-default scale.
WINDOW_LENS = [1, 5, 31, 40, 97, 150]


@pytest.mark.parametrize("window,cap", [(7, 0.0), (45, 30.0), (1000, 0.0), (0, 0.0)])
def test_sliding_window_and_soft_cap(kernel_device, window, cap):
    cfg = HackConfig(partition_size=32, sink_tokens=2)
    feats = dict(window=window, logit_cap=cap, scale=0.2)
    out, ref, *_ = _run_decode(kernel_device, cfg, 64, 2, WINDOW_LENS, seed=window, features=feats)
    assert_matches_reference(out, ref, f"window={window} cap={cap}")


def test_soft_cap_changes_the_result(kernel_device):
    """A cap near the scores' size bends them: the capped kernel matches the capped reference,
    which is far from the uncapped one (so the cap is not silently ignored)."""
    cfg = HackConfig(partition_size=32)
    feats = dict(logit_cap=2.0, scale=0.5)
    out, ref, b, att, q, lay = _run_decode(kernel_device, cfg, 64, 2, [40, 97], features=feats)
    assert_matches_reference(out, ref, "cap=2")
    plain = torch.stack([dense_reference(q[i:i + 1], b["k"][i], b["v"][i], lay, scale=0.5)[0] for i in range(2)])
    assert (plain - ref).abs().max() > 10 * (out - ref).abs().max() + 0.05


def poison_before_window(window: int):
    """A poison for _run_decode: NaN in the side tables (minimum and scale of K and V) of every
    page wholly before each request's window, so reading one (even masked: 0 * NaN) shows."""
    def poison(lay, b):
        for pages, n in zip(b["pages"], b["lens"]):
            first = max(0, n - 1 - window) // lay.page_size
            for tl_, buf in ((lay.k, b["bufs"]["k_buf"]), (lay.v, b["bufs"]["v_buf"])):
                for sec in ("minimum", "scale"):
                    view = tl_.view(buf, sec)
                    for pg in pages[:first]:
                        view[pg] = float("nan")
    return poison


@pytest.mark.parametrize("splits", [1, 3])
def test_pages_before_the_window_are_not_read(kernel_device, splits):
    cfg = HackConfig(partition_size=32, sink_tokens=1)
    out, ref, *_ = _run_decode(kernel_device, cfg, 64, 2, [40, 97, 150], features=dict(window=40),
                               poison=poison_before_window(40), num_splits=splits)
    assert not out.isnan().any()
    assert_matches_reference(out, ref, f"splits={splits}")


def test_window_splits_cover_only_the_window():
    """The flash-decoding split is planned over the pages the window touches, not the context."""
    lay = page_layout(HackConfig(partition_size=32), KV_HEADS, 64)
    att = HackDecodeAttention(lay, 2)
    att.plan(torch.tensor([0, 40]), torch.arange(40), torch.tensor([40 * 32]))
    assert att.splits(None)[0] * att.splits(None)[1] >= 40
    n, per = att.splits(40)  # 41 keys touch at most 3 pages of 32
    assert n * per >= 3 and (n - 1) * per < 3


def test_gemma3_shape_window_and_cap(kernel_device):
    """Gemma-3-270M's attention: 4 query heads on 1 KV head, head_dim 256, the default page
    (64), a window spanning pages and a soft-cap, the layer's own scale."""
    feats = dict(window=70, logit_cap=20.0, scale=256 ** -0.5)
    out, ref, *_ = _run_decode(kernel_device, HackConfig(), 256, 4, [3, 64, 150], kv_heads=1, features=feats)
    assert_matches_reference(out, ref, "D=256 MQA window 70 cap 20")


def test_bad_window_or_cap_is_refused(kernel_device):
    lay = page_layout(HackConfig(partition_size=32), KV_HEADS, 64)
    b = random_batch(lay, [40], [0], 2, device=kernel_device)
    att = HackDecodeAttention(lay, 2)
    att.plan(b["kv_indptr"], b["kv_indices"], b["seq_lens"], b["tail_rows"], b["sink_slots"])
    q = torch.zeros(1, 2, 64, device=kernel_device)
    with pytest.raises(ValueError, match="window"):
        att.run(q, **cache_kwargs(b["bufs"]), window=-3)
    with pytest.raises(ValueError, match="logit_cap"):
        att.run(q, **cache_kwargs(b["bufs"]), logit_cap=float("inf"))


@pytest.mark.device
@pytest.mark.parametrize("splits", [1, 2])
def test_per_head_page_tables(kernel_device, splits):
    """Sparse decode's selection (head_tables): each KV head reads its own closed pages (the first
    always, as many for every head of a request), then the open page; the kernel equals the
    reference over each head's shortened sequence. A list shorter than heads x pages is refused."""
    lay, keep = page_layout(HackConfig(), KV_HEADS, 128), [3, 2, 2]
    b = per_head_selection(lay, [6 * 64 + 10, 5 * 64, 2 * 64 + 1], keep, KV_HEADS * 2, device=kernel_device)
    indptr, indices = b["selection"].head_csr()
    q = torch.randn(3, KV_HEADS * 2, 128, generator=torch.Generator().manual_seed(9))
    att = HackDecodeAttention(lay, KV_HEADS * 2, num_splits=splits)
    att.plan(indptr.to(kernel_device), indices.to(kernel_device), b["selection"].seq_lens.to(kernel_device),
             b["tail_rows"], b["sink_slots"], head_tables=True)
    out = att.run(q.to(kernel_device), **cache_kwargs(b["bufs"]), out=torch.empty(q.shape, device=kernel_device))
    assert_matches_reference(out, per_head_reference(q, b, lay, keep, "hack"), f"per-head tables, {splits} splits")
    with pytest.raises(ValueError, match="2 KV heads x 9 pages need 18"):
        att.plan(indptr, indices[:17], b["selection"].seq_lens, b["tail_rows"], b["sink_slots"], head_tables=True)
    with pytest.raises(ValueError, match="sink_slots"):
        att.plan(indptr, indices, b["selection"].seq_lens, head_tables=True)


@pytest.mark.cuda
@pytest.mark.parametrize("batch,context", [(64, 2048), (8, 8192), (2, 32768)])
def test_real_shapes(kernel_device, batch, context):
    """Llama-3-8B-like (32 query heads, 8 KV heads, head_dim 128), the serving default format,
    every request with a different open-page fill; the kernel picks its own split count."""
    lens = [context - (7 * i) % 64 for i in range(batch)]
    out, ref, *_ = _run_decode(kernel_device, HackConfig(), 128, 4, lens, seed=batch, kv_heads=8)
    assert_matches_reference(out, ref, f"batch {batch} context {context}")
