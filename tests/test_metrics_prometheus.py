"""`hack:` Prometheus metrics: values from records, and SGLang's multiprocess collection."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from engine.metrics.prometheus import PrometheusExport  # noqa: E402
from engine.metrics.sink import MetricsSink  # noqa: E402

T = 1_700_000_000_000_000_000


def _value(registry, name, **labels):
    v = registry.get_sample_value(name, labels)
    assert v is not None, f"{name}{labels} missing"
    return v


def test_records_become_hack_metrics(tmp_path):
    reg = CollectorRegistry()
    sink = MetricsSink(tmp_path, "prefill", "3", prometheus=PrometheusExport(reg), strict=True)
    lab = {"role": "prefill", "server": "prefill-3"}
    sink.record("start", "a", phase="prefill", t_ns=T)
    sink.record("end", "a", phase="prefill", t_ns=T + 300_000_000)     # 0.3 s
    sink.record("span", "a", phase="quantization", t_ns=T, dur_ns=4_000_000)
    sink.record("end", "a", phase="transfer", t_ns=T, dur_ns=2_000_000_000, bytes=500,
                bytes_bf16=3_000)
    sink.record("step", "a", phase="decode", t_ns=T, dur_ns=20_000_000)
    sink.record("finish", "a", t_ns=T, tokens=7)
    sink.record("error", "b", t_ns=T, note="x")
    sink.record("sample", None, t_ns=T, pages_used=5, bytes_codes=100, bytes_side=20,
                bytes_tail=30, bytes_bf16=900, rss_bytes=123)
    sink.close()
    assert _value(reg, "hack:events_total", kind="end", **lab) == 2
    assert _value(reg, "hack:phase_seconds_sum", phase="prefill", **lab) == pytest.approx(0.3)
    assert _value(reg, "hack:phase_seconds_count", phase="quantization", **lab) == 1
    assert _value(reg, "hack:phase_seconds_sum", phase="transfer", **lab) == pytest.approx(2.0)
    assert _value(reg, "hack:decode_step_seconds_sum", **lab) == pytest.approx(0.02)
    assert _value(reg, "hack:transfer_bytes_total", **lab) == 500
    assert _value(reg, "hack:transfer_bf16_bytes_total", **lab) == 3_000
    assert _value(reg, "hack:output_tokens_total", **lab) == 7
    assert _value(reg, "hack:request_errors_total", **lab) == 1
    assert _value(reg, "hack:pages_used", **lab) == 5
    assert _value(reg, "hack:rss_bytes", **lab) == 123
    assert _value(reg, "hack:kv_compression_ratio", **lab) == pytest.approx(6.0)
    text = generate_latest(reg).decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
             if line and not line.startswith("#")}
    assert names and all(n.startswith("hack:") for n in names)


def test_metrics_reach_a_multiprocess_collector_like_sglangs(tmp_path):
    """Written in one process, collected in another, as SGLang's /metrics does."""
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mp_dir),
               HACK_METRICS_RUN_DIR=str(tmp_path / "run"), HACK_METRICS_ROLE="decode",
               HACK_METRICS_INSTANCE="2", HACK_METRICS_PROMETHEUS="1")
    writer = textwrap.dedent("""
        from engine import metrics as hm
        hm.end("transfer", "r", dur_ns=1_000_000, bytes=4096)
        hm.sample(running=3, queued=1)
        hm.close()
    """)
    subprocess.run([sys.executable, "-c", writer], env=env, check=True, timeout=60)
    reader = textwrap.dedent("""
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        print(generate_latest(reg).decode())
    """)
    out = subprocess.run([sys.executable, "-c", reader], env=env, check=True, timeout=60,
                         capture_output=True, text=True).stdout
    assert 'hack:transfer_bytes_total{role="decode",server="decode-2"} 4096.0' in out
    assert 'hack:running{role="decode",server="decode-2"} 3.0' in out
    assert (tmp_path / "run" / "decode-2.arrows").exists()
