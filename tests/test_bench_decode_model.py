"""hack_cli.bench_decode_model without a GPU: the memory plan (weights, KV bytes per request in each
format, the largest batch at equal KV memory) and one decode step of the harness on a tiny shape
on the CPU (HACK through the Triton kernels on the kernel device: the interpreter here)."""
from __future__ import annotations

import json

import pytest
import torch

from hack_cli import bench_decode_model as bench
from hack_ops import HackConfig
from hack_ops.layout import bytes_per_token, page_layout


def test_memory_plan_at_32k():
    s = bench.SHAPES["llama3-8b"]
    assert 14.9 < s.weight_bytes() / bench.GIB < 15.0  # 8.03B parameters in BF16
    tokens = 32768 + 22
    assert bench.bf16_bytes_per_request(s, tokens) == 32 * 2 * tokens * 8 * 128 * 2
    hack = bench.hack_bytes_per_request(s, tokens)
    per_token = bytes_per_token(page_layout(HackConfig(), 8, 128), 32768)["bytes_per_token"] * 32
    assert abs(hack / tokens - per_token) / per_token < 0.03  # the layout's own accounting, one context
    assert bench.plan(s, 32768, 20, 70 * bench.GIB) == {"bf16": 17, "hack": 107}
    assert bench.largest_batch(10, 3) == 3 and bench.largest_batch(2, 3) == 0


def test_without_cuda_it_exits_with_a_sentence(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_one_step_of_each_format_on_a_tiny_shape(tmp_path, kernel_device, one_torch_thread):
    if kernel_device.type != "cpu":
        pytest.skip("on a GPU the benchmark itself runs (scripts/gpu_check.sh)")
    out = tmp_path / "m.json"
    assert bench.main(["--device", "cpu", "--shape", "tiny", "--context", "130", "--kv-gib", "0.001", "--batch", "2",
                       "--steps", "1", "--hack-kernel", "triton", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(r["format"], r["batch"]) for r in doc["results"]] == [("bf16", 2), ("hack", 2)]
    assert doc["device"] == "cpu" and doc["shape"]["layers"] == 2
