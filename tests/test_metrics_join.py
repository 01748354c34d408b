"""Joining prefill and decode records into requests, spans and the exclusive breakdown."""
from __future__ import annotations

import numpy as np
import pytest

from hack_metrics import analysis
from hack_metrics.run_view import build_view
from hack_metrics.runload import RunLoader
from engine.metrics.sink import MetricsSink
from engine.metrics.synthetic import SyntheticSpec, write_synthetic_run

T = 1_700_000_000_000_000_000
MS = 1_000_000


def _view(run_dir, now_ns=None):
    data = RunLoader(run_dir).load()
    data.live = False
    return build_view(data, now_ns=now_ns)


def _pd_request(p: MetricsSink, d: MetricsSink, i: int, room: int | None, base: int) -> None:
    """One disaggregated request; times in ms after `base`:
    arrival 0, queue 0-10, prefill 10-200 (quantization 190-200 inside it),
    transfer 180-300 (overlaps prefill by 20), decode 310-810 with 10 steps,
    first token 360, approximation 40 ms inside decode, finish 810."""
    kw = {} if room is None else {"room": room}
    rid_p, rid_d = (f"p{i}", f"d{i}") if room is not None else (f"r{i}", f"r{i}")
    ms = lambda x: base + x * MS  # noqa: E731
    p.record("arrival", rid_p, t_ns=ms(0), tokens=64, **kw)
    p.record("start", rid_p, phase="queue", t_ns=ms(0), **kw)
    p.record("end", rid_p, phase="queue", t_ns=ms(10), **kw)
    p.record("start", rid_p, phase="prefill", t_ns=ms(10), **kw)
    p.record("span", rid_p, phase="quantization", t_ns=ms(200), dur_ns=10 * MS,
             method="attributed", **kw)
    p.record("end", rid_p, phase="prefill", t_ns=ms(200), **kw)
    p.record("start", rid_p, phase="transfer", t_ns=ms(180), **kw)
    p.record("end", rid_p, phase="transfer", t_ns=ms(300), bytes=1_000, bytes_bf16=6_100, **kw)
    # The receiver reports the same transfer: it must not be counted twice.
    d.record("end", rid_d, phase="transfer", t_ns=ms(300), bytes=1_000, bytes_bf16=6_100,
             dur_ns=None, **kw)
    d.record("start", rid_d, phase="transfer", t_ns=ms(185), **kw)
    d.record("arrival", rid_d, t_ns=ms(1), **kw)
    d.record("first_token", rid_d, t_ns=ms(360), **kw)
    for k in range(10):
        d.record("step", rid_d, phase="decode", t_ns=ms(360 + 50 * k), dur_ns=50 * MS, **kw)
    d.record("span", rid_d, phase="approximation", t_ns=ms(800), dur_ns=40 * MS,
             method="attributed", **kw)
    d.record("finish", rid_d, t_ns=ms(810), tokens=10, **kw)


@pytest.fixture
def pd_run(tmp_path):
    p = MetricsSink(tmp_path, "prefill", "0", strict=True)
    d = MetricsSink(tmp_path, "decode", "0", strict=True)
    for i in range(3):
        _pd_request(p, d, i, room=9000 + i, base=T + i * 2_000 * MS)
    p.close(), d.close()
    return tmp_path


def test_prefill_and_decode_records_join_by_room(pd_run):
    v = _view(pd_run)
    req = v.requests.set_index("key")
    assert list(req.index) == ["room:9000", "room:9001", "room:9002"]
    r = req.loc["room:9001"]
    assert (r["rid_prefill"], r["rid_decode"]) == ("p1", "d1")
    assert r["roles"] == "decode,prefill" and r["status"] == "finished"
    assert r["ttft_s"] == pytest.approx(0.360, abs=1e-9)
    assert r["jct_s"] == pytest.approx(0.810, abs=1e-9)
    assert r["tpot_s"] == pytest.approx(0.450 / 9, abs=1e-9)
    assert (r["prompt_tokens"], r["output_tokens"]) == (64, 10)
    assert (r["bytes"], r["bytes_bf16"]) == (1_000, 6_100)     # one side counted
    assert analysis.wire_ratio(v.requests) == pytest.approx(6.1)
    assert v.notes == []


def test_exclusive_breakdown_adds_up_to_jct(pd_run):
    v = _view(pd_run)
    b = v.breakdown.set_index("key").loc["room:9000"]
    expect = {"queue": 0.010, "prefill": 0.180, "quantization": 0.010,
              "transfer": 0.100,            # 200-300: the part not hidden by prefill
              "other": 0.010,               # 300-310: waiting for the decode server
              "decode": 0.460, "approximation": 0.040, "dequantization": 0.0}
    for phase, seconds in expect.items():
        assert b[phase] == pytest.approx(seconds, abs=1e-9), phase
    sums = v.breakdown[list(analysis.BREAKDOWN_PHASES)].sum(axis=1)
    np.testing.assert_allclose(sums, v.breakdown["jct_s"], atol=1e-9)
    avg = analysis.average_breakdown(v.breakdown)
    assert avg["decode"] == pytest.approx(0.460, abs=1e-9)
    raw = analysis.phase_totals(v.spans)
    t = raw[(raw.key == "room:9000") & (raw.phase == "transfer")]["seconds"].iloc[0]
    assert t == pytest.approx(0.120 + 0.115, abs=1e-9)   # raw: both sides' intervals


def test_room_is_inherited_and_rid_is_the_fallback_key(tmp_path):
    d = MetricsSink(tmp_path, "decode", "0", strict=True)
    d.record("arrival", "x", room=5, t_ns=T)
    d.record("finish", "x", t_ns=T + 100 * MS, tokens=2)       # no room: inherited
    c = MetricsSink(tmp_path, "colocated", "0", strict=True)
    c.record("arrival", "solo", t_ns=T)
    c.record("first_token", "solo", t_ns=T + 30 * MS)
    c.record("finish", "solo", t_ns=T + 90 * MS, tokens=4)
    d.close(), c.close()
    req = _view(tmp_path).requests.set_index("key")
    assert set(req.index) == {"room:5", "rid:solo"}
    assert req.loc["room:5", "jct_s"] == pytest.approx(0.1)
    assert req.loc["rid:solo", "tpot_s"] == pytest.approx(0.060 / 3)


def test_in_flight_request_has_open_spans_to_now(tmp_path):
    p = MetricsSink(tmp_path, "prefill", "0", strict=True)
    p.record("arrival", "a", room=1, t_ns=T)
    p.record("start", "a", phase="prefill", room=1, t_ns=T + 5 * MS)
    # A failed request's unfinished phase stops at its error, not at "now".
    p.record("arrival", "b", room=2, t_ns=T)
    p.record("start", "b", phase="transfer", room=2, t_ns=T + 7 * MS)
    p.record("error", "b", room=2, t_ns=T + 9 * MS + 3, note="peer closed")
    p.close()
    v = _view(tmp_path, now_ns=T + 505 * MS)
    spans = v.spans.set_index("key")
    assert bool(spans.loc["room:1", "open"]) and spans.loc["room:1", "end_ns"] == T + 505 * MS
    assert bool(spans.loc["room:2", "open"]) and spans.loc["room:2", "end_ns"] == T + 9 * MS + 3
    assert v.requests.set_index("key")["status"].to_dict() == {"room:1": "in_flight",
                                                              "room:2": "error"}
    assert v.requests.set_index("key").loc["room:2", "error"] == "peer closed"
    assert len(v.breakdown) == 0                   # only finished requests
    assert analysis.latency_percentiles(v.requests)["count"].tolist() == [0, 0, 0]


def test_one_sided_requests_and_orphan_ends_are_reported(pd_run):
    d = MetricsSink(pd_run, "decode", "1", strict=True)
    d.record("arrival", "lonely", room=777, t_ns=T)
    d.record("end", "lonely", phase="decode", room=777, t_ns=T + MS)
    d.close()
    notes = " ".join(_view(pd_run).notes)
    assert "1 phase end records have no start" in notes
    assert "1 of 4 requests have records from only one role" in notes


def test_synthetic_run_joins_completely(tmp_path):
    run = write_synthetic_run(SyntheticSpec(requests=120, seed=3), root=tmp_path)
    v = _view(run)
    counts = v.requests["status"].value_counts().to_dict()
    assert counts == {"finished": 118, "error": 2}          # every 50th request fails
    assert v.requests["roles"].eq("decode,prefill").all()
    sums = v.breakdown[list(analysis.BREAKDOWN_PHASES)].sum(axis=1)
    np.testing.assert_allclose(sums, v.breakdown["jct_s"], atol=1e-6)
    pct = analysis.latency_percentiles(v.requests).set_index("metric")
    assert pct.loc["JCT", "count"] == 118
    assert pct.loc["TTFT", "p50"] <= pct.loc["TTFT", "p90"] <= pct.loc["TTFT", "p99"]
    # 2-bit codes + side tables: the wire carries 16.4% of the BF16 bytes.
    assert analysis.wire_ratio(v.requests) == pytest.approx(1 / 0.164, rel=1e-3)


def test_thousands_of_requests_are_downsampled(tmp_path):
    run = write_synthetic_run(SyntheticSpec(requests=2000, rate_per_s=2.0, seed=1,
                                            sample_every_s=0.1), root=tmp_path)
    v = _view(run)
    assert len(v.requests) == 2000
    mem = analysis.memory_series(v.samples, v.t0_ns, max_points=300)
    per_server = mem.groupby("server").size()
    raw = v.samples.groupby("server").size()
    assert (raw > 300).all() and (per_server <= 300).all()
    # Buckets keep maxima: the peak survives downsampling.
    for server in raw.index:
        peak = v.samples[v.samples.server == server]["bytes_bf16"].max()
        assert mem[mem.server == server]["bytes_bf16"].max() == peak
    tp = analysis.throughput(v.requests, v.t0_ns)
    fin_tokens = v.requests.loc[v.requests.status == "finished", "output_tokens"].sum()
    bin_s = tp["t_s"].iloc[1] - tp["t_s"].iloc[0]
    assert (tp["tokens_per_s"] * bin_s).sum() == pytest.approx(float(fin_tokens))
