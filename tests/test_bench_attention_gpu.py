"""`hack bench attention --device cuda` without a GPU: the clear refusal, the grid and memory
planning, byte counting, the baseline choice, the dequant strawman against the CPU path's,
the table, and the timing loop on a tiny case on the kernel device (the interpreter here)."""
from __future__ import annotations

import argparse

import pytest
import torch

from hack_cli import bench_attention_gpu as gpu
from hack_cli.main import main
from hack_ops import HackConfig
from hack_ops.layout import page_layout
from hack_ops.paged.dequant import _dequant_tensor
from hack_ops.triton import benchcases as bc
from hack_ops.triton.testing import require_kernel_device


def _args(**kw) -> argparse.Namespace:
    base = dict(shapes=None, batches=None, contexts=None, prefill_tokens=None, repeats=None, quick=False,
                json=False, out=None, clock="wall", threads=None)
    return argparse.Namespace(**{**base, **kw})


def test_without_cuda_it_exits_with_a_sentence(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "attention", "--device", "cuda", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "torch sees none" in err
    assert gpu.main(["--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_grid_defaults_and_overrides():
    g = gpu.grid(_args())
    assert g["shapes"] == ["llama3-8b", "qwen2.5-7b"] and g["batches"] == (1, 8, 32, 128)
    assert g["contexts"] == (2048, 8192, 32768, 131072) and g["prefills"] == (2048, 8192, 32768)
    q = gpu.grid(_args(quick=True, prefill_tokens=0, batches="2,4"))
    assert q["batches"] == (2, 4) and q["contexts"] == (2048, 8192) and q["prefills"] == () and q["repeats"] == 5
    with pytest.raises(ValueError, match="unknown shapes"):
        gpu.grid(_args(shapes="smollm2"))
    with pytest.raises(ValueError, match="--contexts"):
        gpu.grid(_args(contexts="2k"))
    with pytest.raises(ValueError, match="--clock"):
        gpu.run_cuda(_args(clock="cpu"))


def test_cells_that_do_not_fit_are_skipped_with_the_reason():
    g = gpu.grid(_args(shapes="llama3-8b", batches="1,128", contexts="2048,131072", prefill_tokens="4096"))
    cells, skipped = gpu.plan_cells(g, 80 * 2**30)
    # Llama-3-8B: 4 KiB of BF16 K+V per token; 128 x 128K tokens = 64 GiB x 3.5 does not fit.
    assert [(c.batch, c.context) for c in cells if c.phase == "decode"] == [(1, 2048), (1, 131072), (128, 2048)]
    assert [(s["batch"], s["context"]) for s in skipped] == [(128, 131072)] and "GiB" in skipped[0]["reason"]
    assert [c for c in cells if c.phase == "prefill"] == [gpu.Cell("prefill", "llama3-8b", 1, 4096)]
    with pytest.raises(ValueError, match="multiples of the page size"):
        gpu.plan_cells(gpu.grid(_args(contexts="1000")), 2**40)


def test_baseline_choice():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert bc.choose_baseline(cuda, True) is bc.Baseline.FLASHINFER
    assert bc.choose_baseline(cuda, False) is bc.Baseline.SDPA_FLASH
    assert bc.choose_baseline(cpu, True) is bc.Baseline.SDPA


def test_byte_counts():
    lay = page_layout(HackConfig(), 8, 128)  # the serving default: Π=64, 1 sink, K and V tails
    p = lay.page_size
    token16 = 8 * 128 * 2
    pages = lay.k.page_bytes + lay.v.page_bytes
    assert bc.hack_decode_bytes(lay, [2 * p], 32) == 2 * pages + 2 * token16 + 32 * 128 * 2
    # an open page of 5 tokens: FP16 K and V from the tails
    assert bc.hack_decode_bytes(lay, [p + 5], 32) == pages + 5 * 2 * token16 + 2 * token16 + 32 * 128 * 2
    bf16 = bc.bf16_decode_bytes([8192], 8, 32, 128)
    assert bf16 == 8192 * 2 * token16 + 32 * 128 * 2
    ratio = bc.hack_decode_bytes(lay, [8192], 32) / bf16
    assert 0.1 < ratio < 0.25  # 2-bit codes plus side tables: ~1/6 of BF16
    assert bc.dequant_decode_bytes(lay, [8192], 32) == bc.hack_decode_bytes(lay, [8192], 32) + 2 * (bf16 - 32 * 128 * 2)
    shape = bc.AttnShape("t", 32, 8, 128)
    assert bc.prefill_bytes(1000, shape) == 1000 * 128 * 2 * (32 + 32 + 8 + 8)
    assert bc.prefill_flops(4, shape) == 4 * 32 * 128 * 10


def test_dequantize_pages_matches_the_cpu_path():
    cfg = HackConfig(partition_size=32)
    lay = page_layout(cfg, 2, 64)
    g = torch.Generator().manual_seed(0)
    k_buf = torch.randint(0, 256, (6, lay.k.page_bytes), dtype=torch.uint8, generator=g)
    v_buf = torch.randint(0, 256, (6, lay.v.page_bytes), dtype=torch.uint8, generator=g)
    for name, tl_ in (("scale", lay.k), ("minimum", lay.k), ("scale", lay.v), ("minimum", lay.v)):
        buf = k_buf if tl_ is lay.k else v_buf
        view = tl_.view(buf, name)
        view.copy_(torch.rand(view.shape, generator=g).to(view.dtype))  # finite side tables
    table = torch.tensor([[4, 1, 3], [0, 5, 2]])
    k, v = bc.dequantize_pages(lay, k_buf, v_buf, table, torch.float32)
    assert k.shape == (2, 2, 96, 64)
    d = cfg.head_group(64)
    for b in range(2):
        torch.testing.assert_close(k[b], _dequant_tensor(lay.k, k_buf, table[b], 32, 64, 2, d, torch.float32))
        torch.testing.assert_close(v[b], _dequant_tensor(lay.v, v_buf, table[b], 32, 64, 2, d, torch.float32))


def test_table_rendering():
    row = gpu.row_from(gpu.Cell("decode", "llama3-8b", 8, 8192), {"hack": 0.5, "bf16": 2.0, "dequant": 3.0},
                       {"hack": 10**9, "bf16": 6 * 10**9, "dequant": 13 * 10**9}, 4e12)
    assert row["hack_vs_bf16"] == 4.0 and row["hack_vs_dequant"] == 6.0
    assert row["methods"]["hack"]["gb_per_s"] == 2000.0 and row["methods"]["hack"]["fraction_of_copy"] == 0.5
    doc = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-23", "command": "hack bench attention --device cuda",
           "bf16_baseline": "sdpa-flash", "triton": "3.8.0", "torch": "2.14", "repeats": 20, "warmup": 3,
           "copy_bandwidth_gb_per_s": 4000.0, "results": [row],
           "skipped": [{"phase": "decode", "shape": "llama3-8b", "batch": 128, "context": 131072, "reason": "needs x"}]}
    text = gpu.table(doc)
    assert "NVIDIA H100 80GB HBM3 (2026-11-23)" in text and "**sdpa-flash**" in text
    assert "| decode | llama3-8b | 8 | 8192 | 0.500 | 2.000 | 3.000 | x4.00 | x6.00 | 2000 (50%) | 3000 (75%) |" in text
    assert "| 128 | 131072 | skipped: needs x |" in text
    assert "Stopped early" not in text
    partial = gpu.table({**doc, "complete": False, "cells_done": 1, "cells_planned": 30})
    assert "Stopped early: 1 of 30 planned cells measured." in partial


def test_from_json_renders_a_gpu_result_into_the_docs(tmp_path, monkeypatch, capsys):
    """A GPU machine's --out file becomes docs/bench/attention-cuda.json and the kernels.md table
    here, with no GPU; a file that is not such a result is refused with a sentence."""
    row = gpu.row_from(gpu.Cell("decode", "llama3-8b", 1, 2048), {"hack": 1.0, "bf16": 0.5, "dequant": 2.0},
                       {"hack": 10**6, "bf16": 8 * 10**6, "dequant": 9 * 10**6}, 4e12)
    doc = {"device": "NVIDIA H200", "date": "2026-11-26", "command": "python -m hack_cli.bench_attention_gpu",
           "bf16_baseline": "sdpa-flash", "triton": "3.6.0", "torch": "2.11", "repeats": 20, "warmup": 3,
           "copy_bandwidth_gb_per_s": 4098.0, "complete": True, "results": [row], "skipped": []}
    src = tmp_path / "gpu.json"
    src.write_text(__import__("json").dumps(doc))
    kernels = tmp_path / "kernels.md"
    kernels.write_text("# Kernels\n\n<!-- bench-attention-cuda:begin -->\nold\n<!-- bench-attention-cuda:end -->\ntail\n")
    monkeypatch.setattr(gpu, "DOC", kernels)
    monkeypatch.setattr(gpu, "JSON_OUT", tmp_path / "bench" / "attention-cuda.json")
    assert main(["bench", "attention", "--device", "cuda", "--from-json", str(src)]) == 0
    text = kernels.read_text()
    assert "old" not in text and text.endswith("tail\n")
    assert "| decode | llama3-8b | 1 | 2048 | 1.000 | 0.500 | 2.000 | x0.50 | x2.00 |" in text
    assert __import__("json").loads((tmp_path / "bench" / "attention-cuda.json").read_text())["device"] == "NVIDIA H200"
    (tmp_path / "bad.json").write_text("{}")
    assert main(["bench", "attention", "--device", "cuda", "--from-json", str(tmp_path / "bad.json")]) == 2
    assert "not a `--device cuda` result" in capsys.readouterr().err
    assert main(["bench", "attention", "--from-json", str(src)]) == 2
    assert "use it with --device cuda" in capsys.readouterr().err


def test_timing_loop_on_a_tiny_case(kernel_device):
    """The decode and prefill cases end to end on the kernel device (interpreter on CPU tensors
    here): every method runs, HACK agrees with dequantize-then-attend to quantization error."""
    require_kernel_device(kernel_device)
    cfg = HackConfig(partition_size=32)
    shape = bc.AttnShape("tiny", 4, 2, 64)
    base = bc.choose_baseline(kernel_device, False)
    case = bc.DecodeCase(shape, 2, 64, base, kernel_device, config=cfg)
    times = bc.median_ms(case.methods(), 1, 1, bc.Timer(kernel_device), bc.l2_flush(kernel_device))
    assert set(times) == {"hack", "bf16", "dequant"} and min(times.values()) > 0
    assert bc.decode_max_abs_diff(case) < 0.1
    exact = case.run_bf16().float()
    assert exact.shape == case.q.shape and torch.isfinite(exact).all()
    pre = bc.PrefillCase(shape, 40, base, kernel_device, config=cfg)
    times = bc.median_ms(pre.methods(), 1, 0, bc.Timer(kernel_device))
    assert set(times) == {"hack", "bf16", "dequant"}
    with pytest.raises(ValueError, match="repeats"):
        bc.median_ms(case.methods(), 0, 0, bc.Timer(kernel_device))
