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
    assert "- capacity target (>= x5 BF16's tokens in the same budget), hack: met" in text
    result["ratios_vs_bf16"]["hack"]["capacity"] = 4.74
    assert "- capacity target (>= x5 BF16's tokens in the same budget), hack: **missed** by 0.26" in render(result)


def test_serve_table_shows_batched_decode_and_sparse_against_dense_hack():
    result = {"command": "hack bench serve --decode-batch 4", "date": "2026-01-01", "machine": "x86_64",
              "config": {"contexts": [128, 2048], "budget_mb": 256, "requests": 8, "concurrency": 8,
                         "decode_batch": 4},
              "methods": {"bf16": _method(10.0, 1000), "hack": _method(20.0, 6000),
                          "hack-sparse-1024": _method(30.0, 6000)}}
    for m, rate in (("bf16", 25.0), ("hack", 40.0), ("hack-sparse-1024", 80.0)):
        result["methods"][m]["contexts"]["2048"]["batch_decode"] = {"batch": 4, "decode_tok_s": rate}
    result["methods"]["hack"]["contexts"]["128"]["batch_decode"] = {"batch": 4, "decode_tok_s": None, "why": "x"}
    from hack_cli.bench_serve import _batch_ratios

    dense = result["methods"]["hack"]
    assert _batch_ratios(result["methods"]["hack-sparse-1024"], dense) == {"2048": 2.0}  # 128: hack has none
    result["ratios_vs_bf16"] = {m: {"capacity": 6.0, "decode": {"128": 2.0, "2048": 2.0},
                                    "prefill": {"128": 2.0, "2048": 2.0}, "throughput": 2.0,
                                    "batch_decode": _batch_ratios(result["methods"][m], result["methods"]["bf16"])}
                                for m in ("hack", "hack-sparse-1024")}
    result["ratios_vs_hack"] = {"hack-sparse-1024": {"decode": {"128": 1.5, "2048": 1.5},
                                                     "batch_decode": {"2048": 2.0}}}
    text = render(result)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 4 and rows[0].count("|") == rows[2].count("|") == 11
    assert "| hack | 6,000 | 20.0 | 20.0 | n/a | 40.0 | 200 | 200 | 20.0 | 2.0s |" in text
    assert "- hack-sparse-1024 vs bf16: capacity x6.00; decode @128 x2.00, @2048 x2.00; 4 together @2048 x3.20" in text
    assert "- hack-sparse-1024 vs hack (dense decode): decode @128 x1.50, @2048 x1.50; 4 together @2048 x2.00" in text


def test_batched_decode_window_counts_the_tokens_between_the_last_start_and_the_first_end():
    from engine.launcher import _tokens_at

    stamps = [(1.0, 1), (2.0, 2), (3.0, 3)]
    assert [_tokens_at(stamps, t) for t in (0.5, 1.0, 2.5, 9.0)] == [0, 1, 2, 3]


def _sweep(jct: dict[str, dict[float, float]]) -> dict:
    pts = [{"method": m, "link_mbps": r, "jct_s": {"mean": v, "p50": v, "p99": v * 1.1}}
           for m, by_rate in jct.items() for r, v in by_rate.items()]
    return {"workload": "longdoc", "requests": 2, "methods": list(jct), "points": pts,
            "rates_mbps": sorted({r for by_rate in jct.values() for r in by_rate}), "date": "2026-01-01"}


def test_catch_up_rate_interpolates_the_crossing_on_a_log_axis():
    from hack_cli.bench_plot import catch_up_rate, summary_lines

    # bf16 is 20 s slower at 100 and 20 s faster at 400: the crossing is half-way in log rate (200).
    res = _sweep({"bf16": {100: 60.0, 400: 20.0}, "hack": {100: 40.0, 400: 40.0},
                  "dequant": {100: 70.0, 400: 50.0}})
    assert abs(catch_up_rate(res, "hack") - 200.0) < 1e-6
    assert catch_up_rate(res, "dequant") == 100  # bf16 already faster at the lowest rate
    assert catch_up_rate(_sweep({"bf16": {100: 9.0}, "hack": {100: 5.0}}), "hack") is None
    lines = summary_lines(res)
    assert "bf16 catches up with `hack` at ~200 Mbit/s" in lines
    assert "bf16 is already as fast as `dequant` at 100 Mbit/s" in lines


def test_sweep_plot_writes_a_png(tmp_path):
    from hack_cli.bench_plot import plot

    res = _sweep({"bf16": {50: 90.0, 100: 60.0, 1000: 30.0}, "hack": {50: 35.0, 100: 34.0, 1000: 33.0}})
    out = plot(res, tmp_path / "sweep.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_disagg_targets_include_the_fast_link():
    from disagg.bench import compare

    res = _sweep({"bf16": {100: 100.0, 1000: 40.0}, "dequant": {100: 80.0, 1000: 60.0},
                  "hack": {100: 50.0, 1000: 36.0}})
    lines = compare(res)
    assert "at 100 Mbit/s `hack` mean JCT is 50.0% lower than bf16 (target: >= 40% lower; met)" in lines
    assert "at 100 Mbit/s `hack` mean JCT is 37.5% lower than dequant (target: >= 20% lower; met)" in lines
    assert "at 1000 Mbit/s `hack` mean JCT is 10.0% lower than bf16 (target: >= 15% lower; missed)" in lines
