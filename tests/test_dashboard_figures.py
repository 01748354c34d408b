"""Dashboard figures: consistent phase colors, bounded marks, numbers equal to the data."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import pytest

from dashboard import figures as F
from dashboard.sources import Source, load_view
from hack_metrics import analysis, rundir
from engine.metrics.synthetic import SyntheticSpec, write_synthetic_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    hack = write_synthetic_run(SyntheticSpec(requests=300, seed=5), root=root)
    bf16 = write_synthetic_run(SyntheticSpec(requests=300, seed=5, kv_mode="bf16"), root=root)
    return Source(str(hack), "dir").view(), Source(str(bf16), "dir").view()


def _phase_traces(fig):
    by_label = {v: k for k, v in F.PHASE_LABELS.items()}
    return {by_label[t.name]: t for t in fig.data if t.name in by_label}


def test_phase_colors_are_the_same_in_every_figure(runs):
    hack, _ = runs
    for fig in (F.timeline_figure(hack), F.breakdown_figure(hack),
                F.average_breakdown_figure({"hack": hack})):
        traces = _phase_traces(fig)
        assert {"prefill", "transfer", "decode", "quantization"} <= set(traces)
        for phase, trace in traces.items():
            assert trace.marker.color == F.PHASE_COLORS[phase], (fig.layout.title.text, phase)


def test_timeline_shows_a_window_of_the_newest_requests(runs):
    hack, _ = runs
    fig = F.timeline_figure(hack, max_requests=50)
    rows = {y for t in fig.data for y in (t.y or ())}
    assert len(rows) == 50
    assert "newest 50 of 300" in fig.layout.title.text
    newest = set(hack.requests.tail(50)["rid_decode"])
    assert rows == newest
    marks = sum(len(t.x) for t in fig.data)
    assert marks < 50 * 12          # a handful of marks per request, not per step
    # Bars start where their span starts (seconds since the run's first record).
    dec = _phase_traces(fig)["decode"]
    span = hack.spans[(hack.spans.phase == "decode")
                      & hack.spans.key.isin(hack.requests.tail(50)["key"])].iloc[0]
    assert dec.base[0] == pytest.approx((span.start_ns - hack.t0_ns) / 1e9, abs=1e-6)


def test_average_breakdown_bars_add_up_to_the_mean_jct(runs):
    hack, bf16 = runs
    fig = F.average_breakdown_figure({"hack": hack, "bf16": bf16})
    traces = _phase_traces(fig)
    for i, view in enumerate((hack, bf16)):
        total = sum(t.y[i] for t in traces.values())
        assert total == pytest.approx(view.breakdown["jct_s"].mean(), rel=1e-9)
    assert list(fig.data[0].x) == ["hack", "bf16"]
    # The bf16 baseline has no quantization; its bar for it is zero.
    assert traces["quantization"].y[1] == 0 and traces["quantization"].y[0] > 0


def test_memory_and_compression_figures_are_downsampled_and_exact(runs):
    hack, _ = runs
    fig = F.memory_figure(hack, max_points=100)
    assert all(len(t.x) <= 100 for t in fig.data)
    peak = hack.samples["bytes_bf16"].max() / 2**20
    assert max(max(t.y) for t in fig.data if t.name == "BF16 equivalent") == pytest.approx(peak)
    comp = F.compression_figure(hack)
    wire = analysis.wire_ratio(hack.requests)
    assert wire == pytest.approx(1 / 0.164, rel=1e-3)
    assert any(f"{wire:.2f}x" in a.text for a in comp.layout.annotations)


def test_memory_figure_shows_the_pages_a_sparse_step_reads(tmp_path):
    """With sparse decode (samples carry pages_selected / pages_visible) the memory chart adds
    both, per step and layer, on its right axis; without, it has no such trace."""
    run = write_synthetic_run(SyntheticSpec(requests=40, seed=3, sparse_budget=256), root=tmp_path)
    view = Source(str(run), "dir").view()
    fig = F.memory_figure(view)
    def peak(name: str) -> float:
        ys = [np.asarray(t.y, dtype=float) for t in fig.data if t.name == name]
        return float(np.nanmax(np.concatenate(ys)))

    sel = [t for t in fig.data if t.name == "pages the step read (sparse / static eviction)"]
    bf16_axes = {t.yaxis for t in fig.data if t.name == "BF16 equivalent"}
    assert sel and not {t.yaxis for t in sel} & bf16_axes  # the right axis
    assert peak("pages the step read (sparse / static eviction)") <= peak("pages a dense decode step reads")
    dec = view.samples[view.samples["server"] == "decode-0"]
    assert peak("pages a dense decode step reads") == pytest.approx(float(dec["pages_visible"].max()))
    plain = write_synthetic_run(SyntheticSpec(requests=40, seed=3), root=tmp_path / "plain")
    assert not any(t.name == "pages the step read (sparse / static eviction)" for t in F.memory_figure(Source(str(plain), "dir").view()).data)


def test_latency_figure_equals_the_percentiles(runs):
    hack, bf16 = runs
    fig = F.latency_figure({"hack": hack, "bf16": bf16})
    pct = analysis.latency_percentiles(hack.requests).set_index("metric")
    ttft_hack = next(t for t in fig.data if t.name == "hack" and t.xaxis == "x")
    np.testing.assert_allclose(ttft_hack.y, pct.loc["TTFT", ["p50", "p90", "p99"]].to_numpy(
        dtype=float))


def test_empty_run_gives_explanatory_figures(tmp_path):
    run = rundir.create_run("empty", "hack", root=tmp_path)
    view = load_view(run)
    assert not view.data.has_data
    assert any("no metrics streams" in w for w in view.data.warnings)
    for fig in (F.timeline_figure(view), F.breakdown_figure(view), F.memory_figure(view),
                F.compression_figure(view), F.throughput_figure(view),
                F.latency_figure({"x": view}), F.average_breakdown_figure({"x": view}),
                F.servers_figure(view)):
        assert fig.layout.annotations and "no " in fig.layout.annotations[0].text


def test_tier_figure_shows_where_each_prompt_came_from(tmp_path):
    """With a page tier (schema version 3): the tier's size and hit rate per server, and per request
    its prompt split into tokens restored from the tier, taken from the pool and computed, summing
    to the prompt. A run without a tier has no such chart."""
    run = write_synthetic_run(SyntheticSpec(requests=30, seed=5, page_tier=True), root=tmp_path)
    view = Source(str(run), "dir").view()
    assert F.has_tier(view)
    req = view.requests.dropna(subset=["cached_tokens"])
    assert (req["restored_tokens"] > 0).any() and (req["restored_tokens"] <= req["cached_tokens"]).all()
    fig = F.tier_figure(view)
    bars = {t.name: np.asarray(t.y, dtype=float) for t in fig.data if isinstance(t, go.Bar)}
    assert set(bars) == {name for _, name, _ in F.TIER_PARTS}
    total = sum(bars.values())
    assert total == pytest.approx(req["prompt_tokens"].to_numpy(np.float64))
    assert bars["restored from the page tier"].sum() == req["restored_tokens"].sum()
    rates = [np.asarray(t.y, dtype=float) for t in fig.data if t.name.endswith("hit rate (%)")]
    assert rates and np.nanmax(rates[0]) <= 100
    plain = write_synthetic_run(SyntheticSpec(requests=10, seed=5), root=tmp_path / "plain")
    plain_view = Source(str(plain), "dir").view()
    assert not F.has_tier(plain_view)
    assert "no page tier" in F.tier_figure(plain_view).layout.annotations[0].text
