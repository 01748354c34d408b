"""`hack eval recall` (hack_cli/recall_served.py): how each server's greedy continuation is scored
against BF16's, and which servers the command starts. The real servers run in
tests/test_gemma3_server.py (the same measure); the docs quote the command's runs."""
from __future__ import annotations

import pytest


def test_recall_rows_score_each_method_against_bf16():
    """`hack eval recall`: common prefix with BF16's continuation on the prompts BF16 reproduces."""
    import types

    from hack_cli.recall_served import recall_rows, render_recall

    prompts = [types.SimpleNamespace(source=[1, 2, 3, 4]), types.SimpleNamespace(source=[5, 6, 7, 8]),
               types.SimpleNamespace(source=[9, 9, 9, 9])]
    outputs = {"bf16": [[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0]],  # the third is not reproduced
               "hack-4bit-layers": [[1, 2, 0, 4], [5, 6, 7, 8], [9, 9, 9, 9]]}
    args = {"bf16": ["--attention-backend", "torch_native"], "hack-4bit-layers": ["--kv-cache-dtype", "hack"]}
    decisive, rows = recall_rows(prompts, outputs, {"bf16": 10, "hack-4bit-layers": 50}, args, 4)
    assert decisive == [0, 1]
    assert rows[0]["prefixes"] == [4, 4] and rows[0]["agreement"] == 1.0
    assert rows[1]["prefixes"] == [2, 4] and rows[1]["agreement"] == 0.75 and rows[1]["max_total_num_tokens"] == 50
    text = render_recall({"model": "m", "prompts": 3, "new_tokens": 4, "budget_mb": 128.0, "distance": 700,
                          "decisive": decisive, "rows": rows}, "hack eval recall")
    assert "| hack-4bit-layers | --kv-cache-dtype hack | 2, 4 | 0.75 | 50 |" in text


def test_eval_recall_starts_bf16_first_and_the_raised_servers(monkeypatch, tmp_path):
    """The command's servers: BF16 (the reference) first, the hack-4bit-layers server with its
    layers and tensors; no server starts for a bad --4bit-tensors."""
    import hack_cli.recall_served as rs
    import hack_eval.models as models
    from hack_cli.main import build_parser

    started = []

    class Stop(Exception):
        pass

    class FakeServer:
        def __init__(self, path, args):
            started.append(args)
            raise Stop

    import engine.launcher

    monkeypatch.setattr(engine.launcher, "SGLangServer", FakeServer)
    monkeypatch.setattr(models, "prepare", lambda name, log=print: tmp_path)
    monkeypatch.setattr(rs, "recall_prompt", lambda path, i, n_new: None)
    args = build_parser().parse_args(["eval", "recall", "--served", "hack-4bit-layers", "--4bit-layers", "5,11,17",
                                      "--4bit-tensors", "v", "--out", "", "--json-out", ""])
    with pytest.raises(Stop):
        args.func(args)
    assert started[0][:2] == ["--attention-backend", "torch_native"]  # the reference, first
    assert started[0][-5:] == ["--hack-kv-budget-mb", "128.0", "--random-seed", "0", "--disable-radix-cache"]
    started.clear()
    bad = build_parser().parse_args(["eval", "recall", "--served", "hack-4bit-layers", "--4bit-layers", "5",
                                     "--4bit-tensors", "k,v"])
    with pytest.raises(ValueError, match="give one value"):
        bad.func(bad)
    assert started == []
    assert rs.method_args("hack-4bit-layers", (5, 11, 17), "v")[-4:] == [
        "--hack-4bit-layers", "5,11,17", "--hack-4bit-tensors", "v"]
