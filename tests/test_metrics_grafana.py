"""The shipped Grafana dashboard (dashboard/grafana-hack.json): it loads, its panels are well
formed, and every query names only metrics the servers export (and every hack: metric is on
some panel). The real-server check of the same names is in tests/test_operator_e2e.py."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from engine.metrics.prometheus import PrometheusExport  # noqa: E402
from engine.metrics.sink import MetricsSink  # noqa: E402

GRAFANA = Path(__file__).resolve().parent.parent / "dashboard" / "grafana-hack.json"
_METRIC = re.compile(r"\b((?:hack|sglang):[A-Za-z0-9_]+)")


def grafana_queries(path: Path = GRAFANA) -> dict[str, list[str]]:
    """panel title -> its PromQL expressions."""
    dash = json.loads(path.read_text())
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in dash["panels"]}


def metric_names(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def exposition_names(text: str) -> set[str]:
    """Sample names on a Prometheus text page (e.g. hack:phase_seconds_bucket)."""
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def test_dashboard_loads_and_panels_are_well_formed():
    dash = json.loads(GRAFANA.read_text())
    assert dash["uid"] and dash["title"] and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"]["type"] == "prometheus" and p["targets"], p["title"]
        assert {"h", "w", "x", "y"} <= set(p["gridPos"])
        for t in p["targets"]:
            assert metric_names(t["expr"]), f"{p['title']}: {t['expr']!r} names no metric"
            assert t["expr"].count("(") == t["expr"].count(")")


def test_every_query_names_an_exported_metric(tmp_path):
    reg = CollectorRegistry()
    sink = MetricsSink(tmp_path, "decode", "0", prometheus=PrometheusExport(reg), strict=True)
    t = 1_700_000_000_000_000_000
    sink.record("start", "a", phase="prefill", t_ns=t)
    sink.record("end", "a", phase="prefill", t_ns=t + 10**8)
    sink.record("end", "a", phase="transfer", t_ns=t, dur_ns=10**9, bytes=5, bytes_bf16=30)
    sink.record("step", "a", phase="decode", t_ns=t, dur_ns=10**7)
    sink.record("finish", "a", t_ns=t, tokens=3)
    sink.record("error", "b", t_ns=t, note="x")
    sink.record("sample", None, t_ns=t, pages_used=1, pages_total=9, bytes_codes=1,
                bytes_side=1, bytes_tail=1, bytes_bf16=9, running=1, queued=0, rss_bytes=1)
    sink.close()
    exported = exposition_names(generate_latest(reg).decode())
    used = set()
    for title, exprs in grafana_queries().items():
        for e in exprs:
            missing = metric_names(e) - exported
            assert not missing, f"panel {title!r} queries {missing}, not exported"
            used |= metric_names(e)
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported
                if not n.endswith("_created")}
    unused = {f for f in families if f.startswith("hack:")} - \
        {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    assert not unused, f"hack: metrics on no panel: {unused}"
