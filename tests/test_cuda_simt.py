"""The CUDA decode kernel's own source, run on the CPU (hack_ops.cuda.simt: lanes as fibers, the
warp collectives emulated), against hack_ops.attention's 'dequant' mode within
hack_ops.cuda.decode.TOL_*: its control flow (splits, warps' page shares, the FP16 tiles of the
open page and the sinks, the warps' and the splits' merges), indexing (swizzled staging, both code
orders, page tables in any order) and arithmetic, for every format feature the kernel takes.
What it cannot show: speed, memory ordering, the tensor cores' own accumulation order (the GPU
tests, tests/test_cuda_decode.py). Needs nvcc to build (skipped with the reason where missing).
"""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig
from hack_ops.cuda import CodeOrder, CudaDecodeAttention
from hack_ops.cuda.build import nvcc
from hack_ops.cuda.decode import TOL_BF16_MAX_ABS, TOL_MAX_ABS, TOL_MEAN_ABS
from hack_ops.cuda.fragment import convert_pages
from hack_ops.layout import page_layout
from hack_ops.triton.store import cache_kwargs
from hack_ops.triton.testing import dense_reference, per_head_reference, per_head_selection, random_batch

pytestmark = pytest.mark.skipif(nvcc() is None, reason="nvcc is not installed: the kernel's CPU harness cannot be built")


def _run(cfg: HackConfig, d: int, rep: int, lens: list[int], kv_heads: int = 1, seed: int = 0,
         dtype: torch.dtype = torch.float16, features: dict | None = None, order: CodeOrder = CodeOrder.TOKEN,
         splits: int | None = None, poison=None, stages: int = 2):
    from hack_ops.cuda.simt import run_on_cpu

    feats = dict(features or {})
    scale = feats.pop("scale", None)
    lay = page_layout(cfg, kv_heads, d)
    b = random_batch(lay, lens, [0] * len(lens), kv_heads * rep, seed=seed)
    if poison is not None:
        poison(lay, b)
    if order == CodeOrder.FRAGMENT:
        convert_pages(lay, b["bufs"]["k_buf"], b["bufs"]["v_buf"], CodeOrder.FRAGMENT)
    q = torch.randn(len(lens), kv_heads * rep, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    att = CudaDecodeAttention(lay, kv_heads * rep, sm_scale=scale, num_splits=splits, order=order, stages=stages)
    att.plan(b["kv_indptr"], b["kv_indices"], b["seq_lens"], b["tail_rows"], b["sink_slots"])
    out = run_on_cpu(att, q, **cache_kwargs(b["bufs"]), **feats).float()
    ref = torch.stack([dense_reference(q[i:i + 1].float(), b["k"][i], b["v"][i], lay, mode="dequant", scale=scale,
                                       **feats)[0] for i in range(len(lens))])
    return out, ref


def _close(out, ref, what, max_abs=TOL_MAX_ABS, mean_abs=TOL_MEAN_ABS):
    err = (out - ref).abs()
    assert torch.isfinite(out).all(), what
    assert err.max() <= max_abs and err.mean() <= mean_abs, f"{what}: max {float(err.max()):.2e} mean {float(err.mean()):.2e}"


@pytest.mark.parametrize("order", list(CodeOrder))
def test_default_format_with_splits(order, one_torch_thread):
    """GQA 4 on 2 KV heads, lengths around the page edges and 1 sink, 3 splits: every warp, the
    FP16 tiles and both merges."""
    out, ref = _run(HackConfig(), 128, 4, [1, 2, 63, 64, 65, 300, 777], kv_heads=2, splits=3, order=order)
    _close(out, ref, f"{order}")


@pytest.mark.parametrize("order", list(CodeOrder))
@pytest.mark.parametrize("splits", [1, 3])
def test_three_pages_in_flight(order, splits, one_torch_thread):
    """The 3-stage ring (Variant.stages = 3): the same outputs; warps with 1 to 7 pages each, so
    the prologue, the steady state and the drain all run."""
    out, ref = _run(HackConfig(), 128, 4, [1, 130, 65, 777, 1800], kv_heads=2, splits=splits, order=order, stages=3)
    _close(out, ref, f"3 stages, {order}, {splits} splits")


@pytest.mark.parametrize("d,rep,sinks", [(64, 1, 0), (256, 4, 2), (128, 7, 4), (128, 8, 1)])
def test_head_dims_groups_and_sinks(d, rep, sinks, one_torch_thread):
    out, ref = _run(HackConfig(sink_tokens=sinks), d, rep, [sinks + 1, 100, 450], seed=d + rep)
    _close(out, ref, f"D={d} rep={rep} sinks={sinks}")


@pytest.mark.parametrize("window,cap", [(0, 0.0), (45, 30.0), (200, 50.0)])
def test_windows_and_soft_caps(window, cap, one_torch_thread):
    feats = {"window": window, "logit_cap": cap, "scale": 0.06}
    out, ref = _run(HackConfig(sink_tokens=2), 128, 4, [5, 130, 600], features=feats, splits=2)
    _close(out, ref, f"window {window} cap {cap}")


def test_pages_before_the_window_are_not_read(one_torch_thread):
    window = 150

    def poison(lay, b):
        for i, n in enumerate(b["lens"]):
            for pg in b["pages"][i][: max(n - 1 - window, 0) // 64]:
                for name in ("minimum", "scale"):
                    lay.k.view(b["bufs"]["k_buf"], name)[pg] = float("nan")
                    lay.v.view(b["bufs"]["v_buf"], name)[pg] = float("nan")

    out, ref = _run(HackConfig(sink_tokens=0), 128, 4, [600, 90], features={"window": window}, splits=2, poison=poison)
    _close(out, ref, "poisoned pages before the window")


def test_bf16_queries_and_output(one_torch_thread):
    out, ref = _run(HackConfig(), 128, 4, [70, 300], dtype=torch.bfloat16)
    _close(out, ref, "bf16", max_abs=TOL_BF16_MAX_ABS, mean_abs=2e-3)


def per_head_case(splits: int, device: str = "cpu") -> None:
    """Sparse decode's page tables (head_tables): each KV head reads its own subset of the closed
    pages (the first page always, as many for every head of a request), then the open page; the
    kernel (its CPU harness, or the GPU) equals the dense reference over each head's shortened
    sequence, within the kernel's tolerance."""
    lay, keep = page_layout(HackConfig(), 2, 128), [3, 2, 2]
    b = per_head_selection(lay, [6 * 64 + 10, 5 * 64, 2 * 64 + 1], keep, 4, device=device)
    sel = b["selection"]
    indptr, indices = sel.head_csr()
    assert indptr.tolist() == [0, 4, 6, 9]  # 3 + open, 2 (no open page), 2 + open
    q = torch.randn(3, 4, 128, generator=torch.Generator().manual_seed(9)).to(torch.float16)
    att = CudaDecodeAttention(lay, 4, num_splits=splits)
    att.plan(indptr.to(device), indices.to(device), sel.seq_lens.to(device=device, dtype=torch.int32),
             b["tail_rows"], b["sink_slots"], head_tables=True)
    if device == "cpu":
        from hack_ops.cuda.simt import run_on_cpu

        out = run_on_cpu(att, q, **cache_kwargs(b["bufs"])).float()
    else:
        out = att.run(q.to(device), **cache_kwargs(b["bufs"])).float().cpu()
    _close(out, per_head_reference(q, b, lay, keep, "dequant"), "per-head tables")


@pytest.mark.parametrize("splits", [1, 2])
def test_per_head_page_tables(splits, one_torch_thread):
    per_head_case(splits)


def test_per_head_page_tables_are_checked():
    lay = page_layout(HackConfig(), 2, 128)
    att = CudaDecodeAttention(lay, 4)
    with pytest.raises(ValueError, match="sink_slots"):
        att.plan(torch.tensor([0, 2]), torch.tensor([0, 1, 2, 3]), torch.tensor([100]), head_tables=True)
    with pytest.raises(ValueError, match="2 KV heads x 2 pages need 4"):
        att.plan(torch.tensor([0, 2]), torch.tensor([0, 1, 2]), torch.tensor([100]), torch.tensor([0]),
                 torch.tensor([0]), head_tables=True)
