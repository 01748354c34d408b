"""The CUDA decode kernel (hack_ops.cuda.CudaDecodeAttention) against hack_ops.attention.

Tests marked cuda run on a GPU only (scripts/gpu_check.sh; tests/conftest.py skips them
elsewhere): the kernel against the 'dequant' reference on the same pages within
hack_ops.cuda.decode.TOL_* (argued there and in tests/test_cuda_emulate.py), against the CPU
replay of its arithmetic, at small and real shapes, every format feature it takes (sinks, every
open-page fill, windows, soft-caps, splits), both code orders, CUDA graphs, and the driver's
registers against the static profile. The others check, on any machine, what it refuses and why.
Pages come from hack_ops.triton.testing.fill_sequence (the reference quantizer).
"""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig
from hack_ops.cuda import CodeOrder, CudaDecodeAttention, device_why_not, layout_why_not
from hack_ops.cuda.decode import TOL_BF16_MAX_ABS, TOL_MAX_ABS, TOL_MEAN_ABS, choose_splits
from hack_ops.cuda.spec import variant_for
from hack_ops.layout import page_layout
from hack_ops.triton.store import cache_kwargs
from hack_ops.triton.testing import dense_reference, random_batch

KV_HEADS = 2


def _run(cfg: HackConfig, d: int, rep: int, lens: list[int], kv_heads: int = KV_HEADS, seed: int = 0,
         dtype: torch.dtype = torch.float16, features: dict | None = None, order: CodeOrder = CodeOrder.TOKEN,
         splits: int | None = None, poison=None, reference: bool = True, stages: int = 2):
    """The kernel on a GPU batch built on the CPU; out (float, CPU), the 'dequant' reference, the
    batch, q and the layout."""
    from hack_ops.cuda.fragment import convert_pages

    feats = dict(features or {})
    scale = feats.pop("scale", None)
    lay = page_layout(cfg, kv_heads, d)
    b = random_batch(lay, lens, [0] * len(lens), kv_heads * rep, seed=seed, device="cuda")
    if poison is not None:
        poison(lay, b)
    if order == CodeOrder.FRAGMENT:
        convert_pages(lay, b["bufs"]["k_buf"], b["bufs"]["v_buf"], CodeOrder.FRAGMENT)
    q = torch.randn(len(lens), kv_heads * rep, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    att = CudaDecodeAttention(lay, kv_heads * rep, sm_scale=scale, num_splits=splits, order=order, stages=stages)
    att.plan(b["kv_indptr"], b["kv_indices"], b["seq_lens"], b["tail_rows"], b["sink_slots"])
    out = att.run(q.cuda(), **cache_kwargs(b["bufs"]), **feats).float().cpu()
    ref = None
    if reference:
        ref = torch.stack([dense_reference(q[i:i + 1].float(), b["k"][i], b["v"][i], lay, mode="dequant", scale=scale,
                                           **feats)[0] for i in range(len(lens))])
    return out, ref, b, q, lay


def _close(out: torch.Tensor, ref: torch.Tensor, what: str, max_abs: float = TOL_MAX_ABS,
           mean_abs: float = TOL_MEAN_ABS) -> None:
    err = (out - ref).abs()
    assert torch.isfinite(out).all(), what
    assert err.max() <= max_abs and err.mean() <= mean_abs, f"{what}: max {float(err.max()):.2e} mean {float(err.mean()):.2e}"


# ---- on any machine ------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg,d,hq,why", [
    (HackConfig(partition_size=32), 128, 8, "page size 32"),
    (HackConfig(kv_bits=4), 128, 8, "4-bit K / 4-bit V"),
    (HackConfig(k_bits=4), 128, 8, "4-bit K / 2-bit V"),
    (HackConfig(meta_dtype="float32"), 128, 8, "meta_dtype"),
    (HackConfig(tail_tensors="per_channel"), 128, 8, "tail_tensors"),
    (HackConfig(orientation="token_k"), 128, 8, "orientation"),
    (HackConfig(requant_elimination=False), 128, 8, "requant_elimination"),
    (HackConfig(), 32, 8, "head_dim 32"),
    (HackConfig(), 128, 2 * 16, "16 query heads per KV head"),
    (HackConfig(), 128, 5, "5 query heads on 2 KV heads"),
])
def test_formats_outside_the_kernel_are_refused_with_the_reason(cfg, d, hq, why):
    lay = page_layout(cfg, KV_HEADS, d)
    assert why in layout_why_not(lay, hq)
    with pytest.raises(NotImplementedError, match=why):
        CudaDecodeAttention(lay, hq)


def test_the_serving_default_is_covered():
    for d in (64, 128, 256):
        for hq in (2, 8, 14, 16):
            assert layout_why_not(page_layout(HackConfig(), KV_HEADS, d), hq) is None


def test_queries_must_be_bf16_or_fp16_on_a_gpu():
    lay = page_layout(HackConfig(), KV_HEADS, 128)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        variant_for(lay, torch.float32)
    assert variant_for(lay, torch.bfloat16, logit_cap=30.0).name == "d128-bf16-token-cap"
    b = random_batch(lay, [70], [0], 8)
    att = CudaDecodeAttention(lay, 8)
    att.plan(b["kv_indptr"], b["kv_indices"], b["seq_lens"], b["tail_rows"], b["sink_slots"])
    with pytest.raises(ValueError, match="CUDA tensors"):
        att.run(torch.zeros(1, 8, 128, dtype=torch.float16), **cache_kwargs(b["bufs"]))
    if not torch.cuda.is_available():
        assert device_why_not() == "no CUDA device"


def test_split_choice():
    """The rule hack_ops.cuda.decode.choose_splits states, at the H100's 132 SMs (396 blocks)."""
    assert choose_splits(1, 8, 512, 132) == 22  # batch 1 x 32K: ~sqrt(512) splits of 24 pages
    assert choose_splits(1, 8, 128, 132) == 11  # batch 1 x 8K
    assert choose_splits(8, 8, 512, 132) == 6  # 384 blocks: one wave (7 would start a second)
    assert choose_splits(8, 4, 512, 132) == 12
    assert choose_splits(32, 4, 512, 132) == 3
    assert choose_splits(32, 8, 128, 132) == 1  # 256 blocks fill the GPU: unsplit
    assert choose_splits(128, 8, 512, 132) == 1
    assert choose_splits(1, 8, 9, 132) == 1  # too few pages to share between 4 warps twice
    assert choose_splits(1, 1, 1 << 20, 132) == 256  # capped


# ---- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_every_open_page_fill():
    """One request per open-partition fill 0..63 behind one or two closed pages, GQA 4."""
    lens = [(1 + r % 2) * 64 + r for r in range(64)]
    out, ref, *_ = _run(HackConfig(range_search=False), 64, 4, lens)
    _close(out, ref, "every fill")


@pytest.mark.cuda
@pytest.mark.parametrize("d,rep,sinks", [(64, 1, 0), (128, 3, 4), (128, 8, 1), (256, 4, 2), (128, 7, 0)])
def test_shapes_and_mixed_lengths(d, rep, sinks):
    lens = [1, sinks + 1, 63, 64, 65, 3 * 64 + 5, 1000]
    out, ref, *_ = _run(HackConfig(sink_tokens=sinks), d, rep, lens, seed=d + rep)
    _close(out, ref, f"D={d} rep={rep} sinks={sinks}")


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_splits_combine(splits):
    out, ref, *_ = _run(HackConfig(sink_tokens=2), 128, 4, [7, 64, 97, 700, 2000], splits=splits)
    _close(out, ref, f"splits={splits}")


@pytest.mark.cuda
def test_the_kernel_is_the_arithmetic_the_emulation_replays():
    """Closer to the CPU replay of its own roundings than to the reference: the difference left is
    fp32 summation order, ex2.approx and the fp16 output."""
    from hack_ops.cuda.emulate import emulate_request

    lens = [5, 130, 900]
    out, ref, b, q, lay = _run(HackConfig(), 128, 4, lens, seed=3)
    emu = torch.stack([emulate_request(lay, {k: (v.cpu() if v is not None else None) for k, v in b["bufs"].items()},
                                       b["pages"][i], n, q[i].float(), int(b["tail_rows"][i]), int(b["sink_slots"][i]))
                       for i, n in enumerate(lens)])
    _close(out, emu, "vs the emulation", max_abs=1e-3, mean_abs=1e-4)


@pytest.mark.cuda
def test_fragment_order_gives_identical_outputs():
    """The same pages converted to fragment order: the same values in the same registers."""
    lens = [3, 64, 200, 1500]
    a, *_ = _run(HackConfig(), 128, 4, lens, seed=5, reference=False)
    b, ref, *_ = _run(HackConfig(), 128, 4, lens, seed=5, order=CodeOrder.FRAGMENT)
    assert torch.equal(a, b)
    _close(b, ref, "fragment order")


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [1, 3])
def test_three_stages_give_identical_outputs(splits):
    """A 3-page ring per warp (Variant.stages): the pages arrive earlier, the arithmetic is the same."""
    lens = [3, 64, 200, 1500, 4100]
    a, *_ = _run(HackConfig(), 128, 4, lens, seed=6, splits=splits, reference=False)
    b, *_ = _run(HackConfig(), 128, 4, lens, seed=6, splits=splits, reference=False, stages=3)
    assert torch.equal(a, b)


@pytest.mark.cuda
def test_bf16_in_and_out():
    out, ref, *_ = _run(HackConfig(), 128, 4, [50, 9, 700], dtype=torch.bfloat16)
    _close(out, ref, "bf16", max_abs=TOL_BF16_MAX_ABS, mean_abs=2e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("window,cap", [(7, 0.0), (45, 30.0), (1000, 0.0), (0, 0.0), (200, 50.0)])
def test_sliding_window_and_soft_cap(window, cap):
    feats = {"window": window, "logit_cap": cap, "scale": 0.06}
    out, ref, *_ = _run(HackConfig(sink_tokens=2), 128, 4, [5, 64, 130, 700, 1300], features=feats, splits=3)
    _close(out, ref, f"window {window} cap {cap}")


@pytest.mark.cuda
def test_soft_cap_changes_the_result():
    feats = {"logit_cap": 2.0}
    out, ref, b, q, lay = _run(HackConfig(), 128, 4, [300], features=feats)
    _close(out, ref, "cap 2")
    uncapped = dense_reference(q[:1].float(), b["k"][0], b["v"][0], lay, mode="dequant")[0]
    assert (out[0] - uncapped).abs().max() > 20 * TOL_MAX_ABS


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [1, 3])
def test_pages_before_the_window_are_not_read(splits):
    """The side tables of every page wholly before the window are NaN: any read would show."""
    window = 150

    def poison(lay, b):
        for i, n in enumerate(b["lens"]):
            lo = max(n - 1 - window, 0)
            for pg in b["pages"][i][: lo // 64]:
                for name in ("minimum", "scale"):
                    lay.k.view(b["bufs"]["k_buf"], name)[pg] = float("nan")
                    lay.v.view(b["bufs"]["v_buf"], name)[pg] = float("nan")

    out, ref, *_ = _run(HackConfig(sink_tokens=0), 128, 4, [600, 1000, 90], features={"window": window},
                        splits=splits, poison=poison)
    _close(out, ref, f"window with poisoned pages, splits={splits}")


@pytest.mark.cuda
def test_gemma3_shape_window_and_cap():
    """head_dim 256, one KV head, 4 query heads, a 512-token window and Gemma 2's cap of 50."""
    feats = {"window": 511, "logit_cap": 50.0, "scale": 256 ** -0.5}
    out, ref, *_ = _run(HackConfig(), 256, 4, [100, 600, 1500], kv_heads=1, features=feats)
    _close(out, ref, "gemma3 shape")


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [1, 3])
def test_per_head_page_tables_on_the_gpu(splits):
    """Sparse decode's per-head page tables on the GPU: each head's own pages, against the
    reference over each head's shortened sequence (the case tests/test_cuda_simt.py runs on the CPU)."""
    from test_cuda_simt import per_head_case

    per_head_case(splits, "cuda")


@pytest.mark.cuda
def test_replays_inside_a_cuda_graph():
    """SGLang captures decode in CUDA graphs: the ctypes launch is captured and replays on new q."""
    lay = page_layout(HackConfig(), KV_HEADS, 128)
    b = random_batch(lay, [300, 70], [0, 0], 8, device="cuda")
    att = CudaDecodeAttention(lay, 8)
    att.plan(b["kv_indptr"], b["kv_indices"], b["seq_lens"], b["tail_rows"], b["sink_slots"])
    q = torch.randn(2, 8, 128, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    kw = cache_kwargs(b["bufs"])
    att.run(q, **kw, out=out)  # warm-up: builds and loads the library outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        att.run(q, **kw, out=out)
    q.copy_(torch.randn(2, 8, 128, device="cuda", dtype=torch.float16))
    graph.replay()
    torch.testing.assert_close(out, att.run(q, **kw), atol=0, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("shape,batch,context", [
    ((32, 8, 128), 8, 8192),
    ((32, 8, 128), 2, 32768),
    ((28, 4, 128), 16, 4096),
])
def test_real_shapes(shape, batch, context):
    """Llama-3-8B-like and Qwen2.5-7B-like heads, the serving default format, every request with
    a different open-page fill; the kernel picks its own split count."""
    hq, h, d = shape
    lens = [context - (7 * i) % 64 for i in range(batch)]
    out, ref, *_ = _run(HackConfig(), d, hq // h, lens, kv_heads=h, seed=batch)
    _close(out, ref, f"{shape} batch {batch} context {context}")


@pytest.mark.cuda
def test_driver_registers_equal_the_static_profile():
    """What the driver loads is what the cubin profile (tests/test_cuda_static.py) measured."""
    from pathlib import Path

    import triton

    from hack_ops.cuda.build import ActDtype, Variant, device_arch
    from hack_ops.cuda.launch import kernel_attributes, load
    from hack_ops.cuda.profile import profile

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("Triton's wheel ships no cuobjdump here: the static profile cannot be read")
    arch = device_arch()
    for v in (Variant(128, ActDtype.BF16), Variant(128, ActDtype.BF16, CodeOrder.FRAGMENT)):
        attrs = kernel_attributes(load(v, arch), torch.cuda.current_device())
        p = profile(v, arch)
        assert attrs["regs"] == p.regs and attrs["local_bytes"] == 0, (attrs, p)
        assert attrs["blocks_per_sm"] == p.blocks_per_sm, (attrs, p)
