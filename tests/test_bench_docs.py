"""Benchmarks write their tables into the docs between markers (hack_cli.bench_doc)."""
from __future__ import annotations

from hack_cli.bench_doc import markers, replace_block
from hack_cli.bench_serve import render


def test_replace_block_appends_once_then_replaces_in_place(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("# Page\n\nintro\n\n## Later\n")
    replace_block(doc, "x", "first table")
    replace_block(doc, "x", "second table")
    text = doc.read_text()
    begin, end = markers("x")
    assert text.count(begin) == 1 and text.count(end) == 1 and text.count("## Measured") == 1
    assert "second table" in text and "first table" not in text and text.startswith("# Page\n\nintro")


def _method(tok_s: float, cap: int) -> dict:
    ctx = {c: {"decode_tok_s": tok_s, "prefill_tok_s": 10 * tok_s, "ttft_s": 1.0} for c in ("128", "2048")}
    return {"max_total_num_tokens": cap, "contexts": ctx,
            "throughput": {"output_tok_s": tok_s, "latency_p50_s": 2.0}}


def test_serve_table_has_a_row_per_method_and_the_ratios():
    result = {"command": "hack bench serve --quick", "date": "2026-01-01", "machine": "x86_64",
              "config": {"contexts": [128, 2048], "budget_mb": 256, "requests": 8, "concurrency": 8},
              "methods": {"bf16": _method(10.0, 1000), "hack": _method(20.0, 6000)},
              "ratios_vs_bf16": {"hack": {"capacity": 6.0, "decode": {"128": 2.0, "2048": 2.0},
                                          "prefill": {"128": 2.0, "2048": 2.0}, "throughput": 2.0}}}
    text = render(result)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 3 and rows[0].count("|") == rows[2].count("|") == 9
    assert "| hack | 6,000 | 20.0 | 20.0 | 200 | 200 | 20.0 | 2.0s |" in text
    assert "capacity x6.00" in text and "`hack bench serve --quick`" in text
