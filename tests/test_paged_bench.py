"""`hack bench attention` end to end on a tiny grid: the JSON it prints, its ratios, its errors."""
from __future__ import annotations

import json

import pytest

from hack_cli.main import main


def test_bench_attention_json(capsys, tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "attention", "--json", "--shapes", "smollm2", "--batches", "1,2", "--contexts", "200",
               "--repeats", "1", "--prefill-tokens", "96", "--out", str(out)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads(out.read_text())
    decode = [r for r in doc["results"] if r["phase"] == "decode"]
    assert {(r["batch"], r["method"]) for r in decode} == {(b, m) for b in (1, 2) for m in ("hack", "bf16", "dequant")}
    assert all(r["shape"] == "smollm2" and r["context"] == 200 and r["median_ms"] > 0 for r in decode)
    prefill = {r["method"] for r in doc["results"] if r["phase"] == "prefill"}
    assert prefill == {"hack", "hack-exact", "hack-int8", "hack-store", "hack-attn", "bf16", "fp32", "dequant"}
    assert doc["extend_path"].split()[0] in ("vnni", "avx2", "portable", "per-query", "torch")
    assert doc["roofline"]["copy_gb_s"] > 0 and doc["roofline"]["bf16_gops"] > 0
    pre = [r for r in doc["ratios"] if r["phase"] == "prefill"][0]
    base = {(r["method"]): r["median_ms"] for r in doc["results"] if r["phase"] == "prefill"}
    assert pre["baseline"] == min(("bf16", "fp32"), key=base.get)
    assert pre["hack_attn_vs_baseline"] == pytest.approx(base[pre["baseline"]] / base["hack-attn"], rel=0.05, abs=0.01)
    assert all(r["hack_copy_bw_frac"] >= 0 for r in doc["ratios"] if r["phase"] == "decode")
    ms = {(r["phase"], r["batch"], r["method"]): r["median_ms"] for r in doc["results"]}
    for ratio in doc["ratios"]:
        key = (ratio["phase"], ratio["batch"])
        assert ratio["hack_vs_bf16"] == pytest.approx(ms[key + ("bf16",)] / ms[key + ("hack",)], rel=0.05, abs=0.01)
        assert ratio["hack_vs_dequant"] == pytest.approx(ms[key + ("dequant",)] / ms[key + ("hack",)], rel=0.05, abs=0.01)
    assert len(doc["ratios"]) == 3  # two decode cells and the prefill
    assert doc["command"].startswith("hack bench attention --json") and doc["date"]
    # The docs table: one row per ratio, the store rows, and a target line for the prefill.
    from hack_cli.bench_attention_doc import render

    text = render(doc, doc["command"], doc["date"])
    assert sum(line.startswith("| decode |") for line in text.splitlines()) == 2
    assert sum(line.startswith("| prefill |") for line in text.splitlines()) == 1
    assert sum(line.startswith("| store ") for line in text.splitlines()) == len(doc["store"])
    assert "- prefill smollm2 96: HACK (store + attention) x" in text and "(target >= 1x;" in text


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "gpt5"], "unknown shapes"),
    (["--batches", "1,x"], "comma-separated integers"),
    (["--contexts", "0"], "positive"),
    (["--threads", "0"], "--threads"),
])
def test_bench_attention_bad_arguments(argv, message, capsys):
    assert main(["bench", "attention", "--json", *argv]) == 2
    assert message in capsys.readouterr().err
