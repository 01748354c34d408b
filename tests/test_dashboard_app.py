"""The Streamlit app run headless (no browser): what it tells the user about the data."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

from hack_metrics import rundir
from hack_metrics.schema import VERSION_KEY, arrow_schema
from engine.metrics.sink import MetricsSink
from engine.metrics.synthetic import SyntheticSpec, write_synthetic_run

APP = str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py")


def _run(monkeypatch, root, **query) -> AppTest:
    monkeypatch.setenv("HACK_RUNS_DIR", str(root))
    monkeypatch.delenv("HACK_DASHBOARD_RUN_DIR", raising=False)
    monkeypatch.delenv("HACK_DASHBOARD_URL", raising=False)
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update(query)
    at.run()
    assert not at.exception, at.exception
    assert not [e for e in at.error if "failed on this data" in e.value]
    return at


def _charts(at) -> int:
    return len(at.get("plotly_chart"))


def test_no_runs_says_how_to_start_one(monkeypatch, tmp_path):
    at = _run(monkeypatch, tmp_path / "nothing")
    assert "No run directory yet" in at.info[0].value and "hack dashboard --synthetic" in \
        at.info[0].value
    assert _charts(at) == 0


def test_good_run_shows_every_chart(monkeypatch, tmp_path):
    write_synthetic_run(SyntheticSpec(requests=60, seed=2), root=tmp_path)
    at = _run(monkeypatch, tmp_path)
    assert _charts(at) == 8
    assert [w.value for w in at.warning] == []
    assert any("Synthetic run" in i.value for i in at.info)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["finished"] == "59" and metrics["in flight / errors"] == "0 / 1"


def test_damaged_and_unknown_streams_give_warnings_not_a_crash(monkeypatch, tmp_path):
    run = rundir.create_run("damaged", "hack", root=tmp_path)
    for role in ("prefill", "decode", "colocated"):
        rundir.register_server(run, f"{role}-0", role)
    good = MetricsSink(run, "prefill", "0")
    for i in range(4):
        good.record("arrival", f"p{i}", room=i)
        good.record("span", f"p{i}", phase="prefill", room=i, dur_ns=1_000_000)
        good.record("finish", f"p{i}", room=i, tokens=1)
        good.flush()
    good.close()
    data = good.path.read_bytes()
    bad = run / "decode-0.arrows"
    bad.write_bytes(data[:-50])                       # truncated mid-batch
    newer = arrow_schema().with_metadata({VERSION_KEY: b"99"})
    with pa.OSFile(str(run / "router-0.arrows"), "wb") as f, pa.ipc.new_stream(f, newer):
        pass
    import os
    os.utime(bad, (1, 1))                             # written long ago: not live
    at = _run(monkeypatch, tmp_path)
    warnings = " | ".join(w.value for w in at.warning)
    assert "decode-0.arrows: truncated or corrupted" in warnings
    assert "router-0.arrows: metrics schema version 99 is not supported" in warnings
    assert "server colocated-0 (colocated) is in run.json but has no metrics stream" in warnings
    assert _charts(at) == 8                           # the intact prefill stream is shown
    assert {m.label: m.value for m in at.metric}["finished"] == "4"


def test_compare_view_shows_both_runs(monkeypatch, tmp_path):
    a = write_synthetic_run(SyntheticSpec(requests=40, seed=1, kv_mode="bf16"), root=tmp_path,
                            label="base-bf16")
    b = write_synthetic_run(SyntheticSpec(requests=40, seed=1), root=tmp_path, label="hack")
    at = _run(monkeypatch, tmp_path, run=b.name, compare=a.name)
    headers = [h.value for h in at.subheader]
    assert headers == ["hack", "base-bf16"]
    assert _charts(at) == 2 + 2 * 2                   # average + latency, 2 per run


@pytest.mark.parametrize("value", ["0", "abc"])
def test_bad_refresh_setting_falls_back(monkeypatch, tmp_path, value):
    write_synthetic_run(SyntheticSpec(requests=10, seed=1), root=tmp_path)
    monkeypatch.setenv("HACK_DASHBOARD_REFRESH_S", value)
    assert _charts(_run(monkeypatch, tmp_path)) == 8


def test_url_mode_follows_a_live_server(monkeypatch, tmp_path):
    import socket
    import threading
    import time

    import uvicorn

    from engine.metrics.http_api import create_app

    run = write_synthetic_run(SyntheticSpec(requests=25, seed=3), root=tmp_path / "runs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(run), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    try:
        deadline = time.time() + 20
        while not server.started and time.time() < deadline:
            time.sleep(0.05)
        monkeypatch.setenv("HACK_DASHBOARD_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("HACK_RUNS_DIR", str(tmp_path / "elsewhere"))
        at = AppTest.from_file(APP, default_timeout=120)
        at.run()
        assert not at.exception, at.exception
        assert _charts(at) == 8
        assert {m.label: m.value for m in at.metric}["finished"] == "25"
        assert at.subheader[0].value == rundir.read_run(run)["label"]
    finally:
        server.should_exit = True
