"""Triton prefill/extend attention on the kernel device (tests/conftest.py: a CUDA GPU when
present, else TRITON_INTERPRET=1 on CPU tensors) against hack_ops.attention on the CPU:
new tokens attend to cached prefix pages (aligned or not) and to themselves, causally, with
decode-time visibility; the run() stores them on the way (store kernel, pages then tails).
Tolerances: hack_ops.triton.testing (TOL_*), stated and argued there."""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig
from hack_ops.layout import page_layout
from hack_ops.triton.batch import plan_batch
from hack_ops.triton.decode import HackDecodeAttention
from hack_ops.triton.prefill import HackPrefillAttention
from hack_ops.triton.store import cache_kwargs, store
from hack_ops.triton.testing import (assert_matches_reference, chunked_reference, dense_reference, random_batch,
                                     require_kernel_device)

H = 2


@pytest.fixture(autouse=True, scope="module")
def _kernel_device(kernel_device):
    require_kernel_device(kernel_device)


def _extend(device, cfg: HackConfig, d: int, rep: int, prefix: list[int], new: list[int], seed: int = 0,
            heads: int = H, features: dict | None = None, poison=None, **kw):
    """The kernel on `device`; out (and b["q"]) come back on the CPU, next to the reference.
    features: the layer's window / logit_cap (run() and the reference) and scale (sm_scale);
    poison(layout, batch): spoils cache entries the kernel must not read, before it runs."""
    feats = dict(features or {})
    scale = feats.pop("scale", None)
    lay = page_layout(cfg, heads, d)
    b = random_batch(lay, prefix, new, heads * rep, seed=seed, device=device)
    if poison is not None:
        poison(lay, b)
    att = HackPrefillAttention(lay, heads * rep, sm_scale=scale, **kw)
    att.plan(b["qo_indptr"], b["kv_indptr"], b["kv_indices"], b["seq_lens"], b["tail_rows"], b["sink_slots"])
    out = att.run(b["q"], b["k_new"], b["v_new"], **cache_kwargs(b["bufs"]),
                  out=torch.empty(b["q"].shape, device=device), **feats).cpu()
    b["q"] = b["q"].cpu()
    qo = b["qo_indptr"].tolist()
    ref = torch.cat([chunked_reference(b["q"][qo[i]:qo[i + 1]], b["k"][i], b["v"][i], lay, scale=scale, **feats)
                     for i in range(len(new))])
    return out, ref, b, lay


def _mixed(p: int) -> tuple[list[int], list[int]]:
    """Fresh multi-page prompt, aligned prefix, unaligned prefix whose open page closes and
    more pages follow, extend inside one page, one token closing a page, a short sequence."""
    return [0, p, p + 5, 2 * p + 3, 3 * p - 1, 1], [p + 6, 7, 2 * p, 4, 1, 3]


@pytest.mark.parametrize("page,d,rep", [
    (32, 64, 3),
    (64, 64, 1),
    (128, 128, 4),
    pytest.param(64, 256, 3, marks=pytest.mark.slow),
])
def test_mixed_batch(kernel_device, page, d, rep):
    cfg = HackConfig(partition_size=page, sink_tokens=2, range_search=False)
    out, ref, *_ = _extend(kernel_device, cfg, d, rep, *_mixed(page), seed=page + d)
    assert_matches_reference(out, ref, f"Π={page} D={d} rep={rep}")


def test_default_format_and_separation_from_exact(kernel_device):
    """The default format (range search, 1 sink, K and V tails); HACK differs from exact
    attention by far more than the kernel differs from the HACK reference."""
    out, ref, b, lay = _extend(kernel_device, HackConfig(partition_size=32), 64, 2, [0, 40], [70, 30])
    assert_matches_reference(out, ref)
    qo = b["qo_indptr"].tolist()
    exact = torch.cat([dense_reference(b["q"][qo[i]:qo[i + 1]], b["k"][i], b["v"][i], lay, mode="exact")
                       for i in range(2)])
    assert (exact - ref).abs().max() > 10 * (out - ref).abs().max() + 0.05


def test_block_size_and_fp16_fallback_agree(kernel_device):
    cfg = HackConfig(partition_size=32, range_search=False)
    a, ref, *_ = _extend(kernel_device, cfg, 64, 2, [5, 33], [60, 40], block_m=16)
    b, *_ = _extend(kernel_device, cfg, 64, 2, [5, 33], [60, 40], block_m=32, dot_f16=True)
    assert_matches_reference(a, ref)
    assert_matches_reference(b, ref)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_format_options(kernel_device):
    """V quantized as written (tail_tensors='per_channel'), no sinks; 4-bit codes, fp32 tables."""
    for cfg in (HackConfig(partition_size=32, tail_tensors="per_channel", sink_tokens=0, range_search=False),
                HackConfig(partition_size=32, kv_bits=4, meta_dtype="float32", sink_tokens=5, range_search=False)):
        out, ref, *_ = _extend(kernel_device, cfg, 64, 2, [0, 37], [45, 30])
        assert_matches_reference(out, ref, cfg.label())


@pytest.mark.parametrize("cfg", [
    HackConfig(partition_size=32, k_bits=4, sink_tokens=2, range_search=False),  # K 4-bit, V 2-bit
    HackConfig(partition_size=32, kv_bits=4, k_bits=2, tail_tensors="per_channel"),  # K 2-bit, V 4-bit, no V tail
], ids=["K4V2", "K2V4"])
def test_split_bits(kernel_device, cfg):
    """K and V codes with their own bits (HackConfig.k_bits): run() stores them (pages, tails)
    and attends over cached prefix pages, aligned or not, and the new tokens."""
    out, ref, *_ = _extend(kernel_device, cfg, 64, 2, [0, 37], [45, 30])
    assert_matches_reference(out, ref, cfg.label())


def test_prefill_then_decode_steps(kernel_device):
    """A served request: chunked prefill, then decode steps (store + decode kernel), each step
    against the dense reference over the whole sequence so far."""
    cfg = HackConfig(partition_size=32, sink_tokens=1)
    lay = page_layout(cfg, H, 64)
    dev = kernel_device
    b = random_batch(lay, [0], [80], 2 * H, seed=7, device=dev)
    k, v = b["k"][0], b["v"][0]
    indptr, indices = b["kv_indptr"], b["kv_indices"]
    cache = cache_kwargs(b["bufs"])
    rows, sinks = b["tail_rows"], b["sink_slots"]
    g = torch.Generator().manual_seed(8)
    done = 0
    for n in (45, 19):  # prefill in two chunks: the second starts inside an open page
        q = torch.randn(n, 2 * H, 64, generator=g)
        att = HackPrefillAttention(lay, 2 * H)
        att.plan(torch.tensor([0, n], device=dev), indptr, indices, torch.tensor([done + n], device=dev), rows, sinks)
        out = att.run(q.to(dev), k[done:done + n].half().to(dev), v[done:done + n].half().to(dev), **cache,
                      out=torch.empty(q.shape, device=dev)).cpu()
        assert_matches_reference(out, dense_reference(q, k[: done + n], v[: done + n], lay), f"chunk {n}")
        done += n
    dec = HackDecodeAttention(lay, 2 * H)
    for _ in range(3):  # 64 -> 67 tokens: the first step opens a new page
        batch = plan_batch(indptr, indices, torch.tensor([done + 1], device=dev), 32, tail_rows=rows, sink_slots=sinks)
        store(lay, batch, k[done:done + 1].half().to(dev), v[done:done + 1].half().to(dev), **cache)
        dec.plan(indptr, indices, torch.tensor([done + 1], device=dev), rows, sinks)
        q = torch.randn(1, 2 * H, 64, generator=g)
        out = dec.run(q.to(dev), **cache, out=torch.empty(q.shape, device=dev)).cpu()
        assert_matches_reference(out, dense_reference(q, k[: done + 1], v[: done + 1], lay), f"step {done}")
        done += 1


def test_serving_path_with_a_layer_of_4bit_k(kernel_device):
    """engine.gpu_attention (the `hack` backend's kernel path) over a store whose layer 1 gives
    K alone 4 bits (four_bit_layers, raised_tensors='k'): a prompt, then a decode step, per
    layer, write the same page bytes as the CPU path's store and attend like it; each layer's
    bits get their own planned kernels."""
    from engine.gpu_attention import GpuAttention
    from engine.settings import EngineSettings
    from hack_ops import PrefillMode
    from hack_ops.paged import HackKVStore, decode, extend

    cfg = HackConfig(partition_size=32, four_bit_layers=(1,), raised_tensors="k")
    d, hq, dev = 64, 2 * H, kernel_device
    mine = HackKVStore(cfg, 2, H, d, num_pages=8, num_rows=2, device=dev)
    ref = HackKVStore(cfg, 2, H, d, num_pages=8, num_rows=2)
    gpu = GpuAttention(mine, EngineSettings(), PrefillMode.HOMOMORPHIC)
    r2t = torch.zeros(2, 128, dtype=torch.int64)
    r2t[1] = torch.arange(128) + 3 * 32  # pages 3..6
    g = torch.Generator().manual_seed(4)
    done = 0
    for n in (40, 1):
        q, k, v = (torch.randn(n, heads, d, generator=g) for heads in (hq, H, H))
        plan, rplan = gpu.plan(r2t, [1], [done + n], [n]), ref.plan(r2t, [1], [done + n], [n])
        for layer in range(2):
            if n > 1:
                out = gpu.extend(layer, plan, q.to(dev), k.to(dev), v.to(dev), 0.2)
                want = extend(ref, layer, rplan, q, k, v, scale=0.2)
            else:
                out = gpu.decode(layer, plan, q.to(dev), k.to(dev), v.to(dev), 0.2)
                want = decode(ref, layer, rplan, q, k, v, scale=0.2)
            assert_matches_reference(out.cpu(), want, f"layer {layer}, {n} new")
            assert torch.equal(mine.k_pages[layer].cpu(), ref.k_pages[layer]), f"layer {layer} K pages"
            assert torch.equal(mine.v_pages[layer].cpu(), ref.v_pages[layer]), f"layer {layer} V pages"
        planned = gpu._prefill if n > 1 else gpu._decode  # keys (query heads, K bits, V bits)
        assert sorted(planned) == [(hq, 2, 2), (hq, 4, 2)]
        done += n


def test_serving_path_sparse_decode(kernel_device):
    """engine.gpu_attention with sparse decode (--hack-sparse-budget on a GPU): two requests past
    the budget and one under it, prompts stored, then decode steps whose SparseDecode selects on
    the device (hack_ops.triton.sparse) and whose kernel reads the per-head tables: the pages read
    and every output equal the CPU path's sparse decode (the compiled selection, the CPU kernel)."""
    from engine.gpu_attention import GpuAttention
    from engine.settings import EngineSettings
    from hack_ops import PrefillMode
    from hack_ops.paged import HackKVStore, decode, extend
    from hack_ops.paged.sparse import SparseDecode
    from hack_ops.sparse import SparseConfig
    from hack_ops.triton.sparse import select_on_device

    cfg = HackConfig(partition_size=32, sink_tokens=1)
    sp = SparseConfig(budget_tokens=4 * 32, recent_tokens=32, dense_layers=0)
    d, hq, dev = 64, 3 * H, kernel_device
    mine = HackKVStore(cfg, 1, H, d, num_pages=40, num_rows=4, device=dev)
    ref = HackKVStore(cfg, 1, H, d, num_pages=40, num_rows=4)
    gpu = GpuAttention(mine, EngineSettings(), PrefillMode.HOMOMORPHIC)
    r2t = torch.zeros(4, 512, dtype=torch.int64)
    for row, first in ((1, 0), (2, 14), (3, 28)):
        r2t[row, :384] = torch.arange(384) + first * 32
    g = torch.Generator().manual_seed(11)
    lens = [0, 0, 0]
    for new in ((300, 200, 90), (1, 1, 1), (1, 1, 1)):
        n = sum(new)
        q, k, v = (torch.randn(n, heads, d, generator=g) for heads in (hq, H, H))
        lens = [a + b for a, b in zip(lens, new)]
        plan, rplan = gpu.plan(r2t, [1, 2, 3], lens, list(new)), ref.plan(r2t, [1, 2, 3], lens, list(new))
        if n > 3:
            gpu.extend(0, plan, q.to(dev), k.to(dev), v.to(dev), 0.2)
            extend(ref, 0, rplan, q, k, v, scale=0.2)
            continue
        mine_step, ref_step = SparseDecode(sp, selector=select_on_device), SparseDecode(sp)
        out = gpu.decode(0, plan, q.to(dev), k.to(dev), v.to(dev), 0.2, sparse=mine_step)
        want = decode(ref, 0, rplan, q, k, v, scale=0.2, sparse=ref_step)
        assert mine_step.last is not None and ref_step.last is not None
        assert mine_step.pages_read == ref_step.pages_read == 4 + 4 + 2  # the budget's 4 closed pages, the short one's 2
        for b in range(3):
            assert mine_step.last.heads_pages(b).tolist() == ref_step.last.heads_pages(b).tolist(), b
        assert_matches_reference(out.cpu(), want, f"sparse decode at {lens}")


@pytest.mark.parametrize("window,cap", [(None, 0.0), (37, 20.0)])
def test_serving_path_dense_prefill(kernel_device, window, cap):
    """engine.gpu_attention with PrefillMode.DENSE (the GPU's `--hack-prefill auto`): two
    requests, a fresh prompt each, then a chunk over the cached prefix that closes the prefix's
    open page (32 + 8 tokens, then 30), then a decode step: page bytes equal the CPU store's
    and every output equals the CPU path's dense prefill (hack_ops.paged.extend, prefill
    'dense'), which attends the same stored values in the same precision; a sliding window with
    a soft-cap goes through the masked dense path."""
    from engine.gpu_attention import GpuAttention
    from engine.settings import EngineSettings
    from hack_ops import PrefillMode
    from hack_ops.paged import HackKVStore, decode, extend

    cfg = HackConfig(partition_size=32, sink_tokens=1)
    d, hq, dev = 64, 2 * H, kernel_device
    mine = HackKVStore(cfg, 1, H, d, num_pages=12, num_rows=3, device=dev)
    ref = HackKVStore(cfg, 1, H, d, num_pages=12, num_rows=3)
    gpu = GpuAttention(mine, EngineSettings(prefill="dense"), PrefillMode.DENSE)
    r2t = torch.zeros(3, 160, dtype=torch.int64)
    r2t[1] = torch.arange(160) + 5 * 32  # pages 5..9
    r2t[2, :96] = torch.arange(96)  # pages 0..2
    g = torch.Generator().manual_seed(7)
    done = [0, 0]
    for new in ((40, 33), (30, 29), (1, 1)):
        n = sum(new)
        q, k, v = (torch.randn(n, heads, d, generator=g) for heads in (hq, H, H))
        lens = [done[0] + new[0], done[1] + new[1]]
        plan, rplan = gpu.plan(r2t, [1, 2], lens, list(new)), ref.plan(r2t, [1, 2], lens, list(new))
        if n > 2:
            out = gpu.extend(0, plan, q.to(dev), k.to(dev), v.to(dev), 0.2, window=window, logit_cap=cap)
            want = extend(ref, 0, rplan, q, k, v, scale=0.2, window=window, logit_cap=cap,
                          prefill=PrefillMode.DENSE)
            assert torch.allclose(out.cpu(), want, atol=2e-5, rtol=0), (new, (out.cpu() - want).abs().max())
        else:
            out = gpu.decode(0, plan, q.to(dev), k.to(dev), v.to(dev), 0.2, window=window, logit_cap=cap)
            want = decode(ref, 0, rplan, q, k, v, scale=0.2, window=window, logit_cap=cap)
            assert_matches_reference(out.cpu(), want, f"decode after dense prefill {new}")
        assert torch.equal(mine.k_pages[0].cpu(), ref.k_pages[0]) and torch.equal(mine.v_pages[0].cpu(), ref.v_pages[0])
        for name in mine.tails:  # the open pages' FP16 tokens too
            for row, length in ((1, lens[0]), (2, lens[1])):
                m = length % 32
                assert torch.equal(mine.tails[name][0][row, :m].cpu(), ref.tails[name][0][row, :m]), (name, row)
        done = lens


@pytest.mark.parametrize("window,cap", [(None, 0.0), (37, 20.0)])
def test_serving_path_dense_prefill_mixed_batch(kernel_device, window, cap):
    """The batch chunked prefill makes under load, through engine.gpu_attention's dense prefill:
    a chunk over a cached prefix that ends mid-page, a request at a decode step and a cold
    prompt (no prefix: on a GPU its keys are the chunk's own, lower-right causal; the CPU path
    once called its flash kernel over zero keys there) in one extend. Every output equals the
    CPU path's dense prefill of the same batch and the pages are the CPU store's bytes."""
    from engine.gpu_attention import GpuAttention
    from engine.settings import EngineSettings
    from hack_ops import PrefillMode
    from hack_ops.paged import HackKVStore, extend

    cfg = HackConfig(partition_size=32, sink_tokens=1)
    d, hq, dev = 64, 2 * H, kernel_device
    mine = HackKVStore(cfg, 1, H, d, num_pages=12, num_rows=3, device=dev)
    ref = HackKVStore(cfg, 1, H, d, num_pages=12, num_rows=3)
    gpu = GpuAttention(mine, EngineSettings(prefill="dense"), PrefillMode.DENSE)
    r2t = torch.zeros(3, 128, dtype=torch.int64)
    r2t[0, :64] = torch.arange(64) + 10 * 32  # pages 10..11
    r2t[1, :96] = torch.arange(96) + 5 * 32  # pages 5..7
    r2t[2, :96] = torch.arange(96)  # pages 0..2
    g = torch.Generator().manual_seed(9)
    # (rows, lengths after, new tokens): two cold prompts, then the mixed batch
    for rows, lens, new in (([1, 2], [45, 40], [45, 40]), ([1, 2, 0], [83, 41, 50], [38, 1, 50])):
        n = sum(new)
        q, k, v = (torch.randn(n, heads, d, generator=g) for heads in (hq, H, H))
        plan, rplan = gpu.plan(r2t, rows, lens, new), ref.plan(r2t, rows, lens, new)
        out = gpu.extend(0, plan, q.to(dev), k.to(dev), v.to(dev), 0.2, window=window, logit_cap=cap)
        want = extend(ref, 0, rplan, q, k, v, scale=0.2, window=window, logit_cap=cap, prefill=PrefillMode.DENSE)
        assert torch.isfinite(out).all()
        assert torch.allclose(out.cpu(), want, atol=2e-5, rtol=0), (new, (out.cpu() - want).abs().max())
        assert torch.equal(mine.k_pages[0].cpu(), ref.k_pages[0]) and torch.equal(mine.v_pages[0].cpu(), ref.v_pages[0])


def test_bad_input_is_refused(kernel_device):
    lay = page_layout(HackConfig(partition_size=32), H, 64)
    b = random_batch(lay, [3], [20], 2, device=kernel_device)
    att = HackPrefillAttention(lay, 2)
    with pytest.raises(RuntimeError, match="plan"):
        att.run(b["q"], b["k_new"], b["v_new"], **cache_kwargs(b["bufs"]))
    with pytest.raises(ValueError, match="block_m"):
        HackPrefillAttention(lay, 2, block_m=24)
    att.plan(b["qo_indptr"], b["kv_indptr"], b["kv_indices"], b["seq_lens"], b["tail_rows"], b["sink_slots"])
    with pytest.raises(ValueError, match="k must be"):
        att.run(b["q"], b["k_new"][:-1], b["v_new"], **cache_kwargs(b["bufs"]))
    with pytest.raises(ValueError, match="q must be"):
        att.run(b["q"][:, :1], b["k_new"], b["v_new"], **cache_kwargs(b["bufs"]))


@pytest.mark.parametrize("window,cap", [(7, 0.0), (45, 30.0), (1000, 0.0)])
def test_sliding_window_and_soft_cap(kernel_device, window, cap):
    """Windows inside one page (32), spanning pages off the grid, wider than every context, over
    the mixed batch (aligned and unaligned cached prefixes, sinks that leave the window), with
    and without a soft-cap, at a non-default scale."""
    cfg = HackConfig(partition_size=32, sink_tokens=2, range_search=False)
    feats = dict(window=window, logit_cap=cap, scale=0.2)
    out, ref, *_ = _extend(kernel_device, cfg, 64, 2, *_mixed(32), seed=window, features=feats)
    assert_matches_reference(out, ref, f"window={window} cap={cap}")


def test_soft_cap_changes_the_result(kernel_device):
    cfg = HackConfig(partition_size=32, range_search=False)
    feats = dict(logit_cap=2.0, scale=0.5)
    out, ref, b, lay = _extend(kernel_device, cfg, 64, 2, [40], [30], features=feats)
    assert_matches_reference(out, ref, "cap=2")
    plain = chunked_reference(b["q"], b["k"][0], b["v"][0], lay, scale=0.5)
    assert (plain - ref).abs().max() > 10 * (out - ref).abs().max() + 0.05


def test_pages_before_the_window_are_not_read(kernel_device):
    """NaN in the side tables of every cached page wholly before the first new token's window:
    a read (even a masked one: 0 * NaN) would show in the output."""
    window = 40

    def poison(lay, b):
        for pages, pre in zip(b["pages"], b["prefix"]):
            first = max(0, pre - window) // lay.page_size
            for tl_, buf in ((lay.k, b["bufs"]["k_buf"]), (lay.v, b["bufs"]["v_buf"])):
                for sec in ("minimum", "scale"):
                    view = tl_.view(buf, sec)
                    for pg in pages[:first]:
                        view[pg] = float("nan")

    cfg = HackConfig(partition_size=32, sink_tokens=1, range_search=False)
    out, ref, *_ = _extend(kernel_device, cfg, 64, 2, [100, 130], [20, 5], features=dict(window=window),
                           poison=poison)
    assert not out.isnan().any()
    assert_matches_reference(out, ref, "poisoned pages before the window")


def test_gemma3_shape_window_and_cap(kernel_device):
    """Gemma-3-270M's attention: 4 query heads on 1 KV head, head_dim 256, the default format
    (Π=64), a fresh prompt and an unaligned cached prefix, a window spanning pages, a soft-cap."""
    feats = dict(window=70, logit_cap=20.0, scale=256 ** -0.5)
    out, ref, *_ = _extend(kernel_device, HackConfig(), 256, 4, [0, 70], [90, 20], heads=1, features=feats)
    assert_matches_reference(out, ref, "D=256 MQA window 70 cap 20")


@pytest.mark.cuda
@pytest.mark.parametrize("prefix,new", [
    ([0, 2048, 8191], [2048, 512, 1025]),  # a fresh 2K prompt, aligned and unaligned 8K-ish prefixes
    ([31 * 1024], [1024]),  # the last 1K of a 32K context over 31K cached tokens
])
def test_real_shapes(kernel_device, prefix, new):
    """Llama-3-8B-like (32 query heads, 8 KV heads, head_dim 128), the serving default format."""
    out, ref, *_ = _extend(kernel_device, HackConfig(), 128, 4, prefix, new, seed=len(new), heads=8)
    assert_matches_reference(out, ref, f"prefix {prefix} new {new}")
