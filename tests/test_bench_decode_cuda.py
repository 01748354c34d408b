"""hack_cli.bench_decode_cuda without a GPU: the refusal, the grid's memory planning, the bytes the
CUDA kernel reads, the targets per cell, the table and rendering a GPU run's JSON into the docs."""
from __future__ import annotations

import json

import torch

from hack_cli import bench_decode_cuda as bench
from hack_cli import bench_doc
from hack_ops import HackConfig
from hack_ops.layout import page_layout
from hack_ops.triton import benchcases as bc


def test_without_cuda_it_exits_with_a_sentence(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--batches", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert bench.main(["--repeats", "0"]) == 2


def test_cells_that_do_not_fit_are_skipped():
    cells, skipped = bench.plan_cells(["llama3-8b"], (8, 128), (2048, 32768), 30 * 2**30)
    # Llama-3-8B: 4 KiB of BF16 K+V per token; 128 x 32K = 16 GiB x 2.4 does not fit in 30 GiB
    assert [(c.batch, c.context) for c in cells] == [(8, 2048), (8, 32768), (128, 2048)]
    assert [(s["batch"], s["context"]) for s in skipped] == [(128, 32768)]


def test_the_kernel_reads_the_pages_without_k_sums():
    lay = page_layout(HackConfig(), 8, 128)
    full = bc.hack_decode_bytes(lay, [64 * 10 + 5], 32)
    assert bench.cuda_decode_bytes(lay, [64 * 10 + 5], 32) == full - 10 * lay.k.sums.nbytes
    per_page = lay.k.codes.nbytes + lay.k.minimum.nbytes + lay.k.scale.nbytes + lay.v.page_bytes
    assert bench.cuda_decode_bytes(lay, [64 * 10], 0) == 10 * per_page + 2 * 8 * 128 * 2  # + the sink


def test_targets_and_table():
    cell = bench.Cell("llama3-8b", 32, 32768)
    assert bench.targets(cell, 4.5, 0.6) == {"ge_1x": True, "ge_3x_batch8_8k": True, "ge_4x_32k": True,
                                             "ge_half_copy_bw_32k": True}
    small = bench.targets(bench.Cell("llama3-8b", 1, 2048), 0.8, 0.1)
    assert small == {"ge_1x": False, "ge_3x_batch8_8k": None, "ge_4x_32k": None, "ge_half_copy_bw_32k": None}
    times = {"cuda": 1.0, "cuda_fragment": 0.9, "triton": 20.0, "bf16": 4.0}
    nbytes = {"cuda": 2 * 10**9, "cuda_fragment": 2 * 10**9, "triton": 2 * 10**9, "bf16": 12 * 10**9}
    row = bench.row_from(cell, times, nbytes, 5e12, (1, 512))
    assert row["cuda_vs_bf16"] == 4.0 and row["fragment_vs_bf16"] == 4.44 and row["cuda_vs_triton"] == 20.0
    assert row["targets"]["ge_4x_32k"] and row["targets"]["ge_half_copy_bw_32k"] is False  # 2 TB/s of 5
    doc = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-01", "command": "python -m hack_cli.bench_decode_cuda",
           "bf16_baseline": "sdpa-flash", "torch": "2.11", "triton": "3.6.0", "nvcc": "V13.0.88", "repeats": 20,
           "warmup": 3, "copy_bandwidth_gb_per_s": 5000.0, "complete": True, "results": [row],
           "skipped": [{"shape": "llama3-8b", "batch": 128, "context": 131072, "reason": "needs x"}]}
    text = bench.table(doc)
    assert "NVIDIA H100 80GB HBM3 (2026-12-01)" in text and "**sdpa-flash**" in text
    assert ("| llama3-8b | 32 | 32768 | 1.000 | 0.900 | 20.000 | 4.000 | x4.00 | x4.44 | 2000 (40%) | 3000 (60%) "
            "| missed: ge_half_copy_bw_32k |") in text
    assert "| 128 | 131072 | skipped: needs x |" in text
    assert "Stopped early: 1 of 9" in bench.table({**doc, "complete": False, "cells_done": 1, "cells_planned": 9})


def test_sparse_rows_against_dense_cuda_and_bf16():
    """--sparse-budgets: each budget's step is the device selection plus the CUDA kernel over its
    tables, judged against dense CUDA decode (x5 at 32K / 2K, the selection <= 15% of the step)."""
    cell = bench.Cell("llama3-8b", 8, 32768)
    times = {"cuda": 2.0, "cuda_fragment": 1.9, "triton": 20.0, "bf16": 8.0,
             "select_2048": 0.1, "cuda_sparse_2048": 0.3, "triton_sparse_2048": 1.5,
             "select_1024": 0.1, "cuda_sparse_1024": 0.15, "triton_sparse_1024": 0.8}
    lay = page_layout(HackConfig(), 8, 128)
    assert bench.select_bytes(lay, [64 * 10 + 5], 32) == 10 * (lay.k.minimum.nbytes + lay.k.scale.nbytes) + 32 * 128 * 2
    row = bench.row_from(cell, times, {m: 10**9 for m in times}, 5e12, (1, 512))
    assert row["sparse"]["2048"] == {"step_ms": 0.4, "vs_cuda": 5.0, "vs_bf16": 20.0, "selection_share": 0.25,
                                     "triton_sparse_ms": 1.5,
                                     "targets": {"ge_5x_dense_32k_2k": True, "selection_le_15pct": False}}
    assert row["sparse"]["1024"]["targets"] == {"ge_5x_dense_32k_2k": None, "selection_le_15pct": None}
    doc = {"device": "NVIDIA H100", "date": "2026-12-01", "command": "c", "bf16_baseline": "sdpa-flash",
           "torch": "2.11", "triton": "3.6.0", "repeats": 20, "warmup": 3, "copy_bandwidth_gb_per_s": 3000.0,
           "results": [row]}
    text = bench.table(doc)
    assert ("| llama3-8b | 8 | 32768 | 2048 | 0.100 | 0.300 | 0.400 | x5.00 | x20.00 | 25% | 1.500 "
            "| missed: selection_le_15pct |") in text
    assert "| llama3-8b | 8 | 32768 | 1024 | 0.100 | 0.150 | 0.250 | x8.00 | x32.00 | 40% | 0.800 | n/a |" in text
    assert "Sparse decode" not in bench.table({**doc, "results": [bench.row_from(cell, {
        m: times[m] for m in bench.METHODS}, {m: 10**9 for m in bench.METHODS}, 5e12, (1, 512))]})


def test_from_json_renders_into_the_docs(tmp_path, monkeypatch, capsys):
    row = bench.row_from(bench.Cell("qwen2.5-7b", 8, 8192), {"cuda": 0.5, "cuda_fragment": 0.45, "triton": 5.0,
                                                             "bf16": 1.0},
                         {m: 10**9 for m in bench.METHODS}, 4e12, (2, 64))
    doc = {"device": "NVIDIA H100", "date": "2026-12-01", "command": "python -m hack_cli.bench_decode_cuda",
           "bf16_baseline": "sdpa-flash", "torch": "2.11", "triton": "3.6.0", "repeats": 20, "warmup": 3,
           "copy_bandwidth_gb_per_s": 3000.0, "results": [row]}
    src = tmp_path / "run.json"
    src.write_text(json.dumps(doc))
    kernels = tmp_path / "kernels.md"
    kernels.write_text("# Kernels\n\n<!-- bench-decode-cuda:begin -->\nold\n<!-- bench-decode-cuda:end -->\ntail\n")
    monkeypatch.setattr(bench_doc, "DOCS", tmp_path)
    assert bench.main(["--from-json", str(src)]) == 0
    text = kernels.read_text()
    assert "old" not in text and text.endswith("tail\n")
    assert "| qwen2.5-7b | 8 | 8192 | 0.500 | 0.450 | 5.000 | 1.000 | x2.00 |" in text
    assert "missed: ge_3x_batch8_8k" in text
    assert json.loads((tmp_path / "bench" / "decode-cuda.json").read_text())["device"] == "NVIDIA H100"
    src.write_text("{}")
    assert bench.main(["--from-json", str(src)]) == 2


def _fake_gpu(monkeypatch):
    """What run() asks of torch.cuda and benchcases before the first cell, answered without a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bc, "choose_baseline", lambda device, fi: bc.Baseline.SDPA_FLASH)
    monkeypatch.setattr(bc, "l2_flush", lambda device: None)
    monkeypatch.setattr(bc, "copy_bandwidth", lambda device: 3e12)


def test_a_failing_cell_is_recorded_and_the_grid_goes_on(tmp_path, monkeypatch):
    _fake_gpu(monkeypatch)
    times = {"cuda": 0.5, "cuda_fragment": 0.5, "triton": 5.0, "bf16": 2.0}

    def measure(cell, baseline, device, repeats, flush, copy_bps, budgets=()):
        if cell.batch == 8:
            raise RuntimeError("CUDA out of memory while planning\nsecond line")
        return bench.row_from(cell, times, {m: 10**9 for m in bench.METHODS}, copy_bps, (1, 32))

    monkeypatch.setattr(bench, "measure_cell", measure)
    monkeypatch.setattr(bench, "_context_lost", lambda device: False)
    out = tmp_path / "grid.json"
    assert bench.main(["--shapes", "llama3-8b", "--batches", "1,8,32", "--contexts", "2048", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and [r["batch"] for r in doc["results"]] == [1, 32]
    assert doc["skipped"] == [{"shape": "llama3-8b", "batch": 8, "context": 2048,
                               "reason": "failed: CUDA out of memory while planning"}]
    # a sticky error (the context is gone): the grid stops there, and says it did not finish
    monkeypatch.setattr(bench, "_context_lost", lambda device: True)
    assert bench.main(["--shapes", "llama3-8b", "--batches", "1,8,32", "--contexts", "2048", "--out", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and doc["cells_done"] == 2 and [r["batch"] for r in doc["results"]] == [1]


def test_the_split_sweep_writes_one_entry_per_cell(tmp_path, monkeypatch):
    _fake_gpu(monkeypatch)
    seen = []

    def sweep(cell, baseline, device, repeats, flush, counts):
        seen.append(counts)
        return {"shape": cell.shape, "batch": cell.batch, "context": cell.context, "auto_splits": [4, 8],
                "ms": {"bf16": 0.1, "splits_1": 0.05, "splits_4": 0.02, "auto": 0.02}}

    monkeypatch.setattr(bench, "sweep_cell", sweep)
    out = tmp_path / "splits.json"
    assert bench.main(["--shapes", "qwen2.5-7b", "--batches", "1,8", "--contexts", "8192", "--out", str(out),
                       "--sweep-splits", "1,4"]) == 0
    doc = json.loads(out.read_text())
    assert [(r["batch"], r["auto_splits"]) for r in doc["sweep"]] == [(1, [4, 8]), (8, [4, 8])]
    assert seen == [(1, 4), (1, 4)] and "results" not in doc
    assert bench.main(["--sweep-splits", "0,4", "--out", str(out)]) == 2  # counts must be positive
