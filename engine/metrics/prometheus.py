"""Prometheus export of the metrics records, next to SGLang's own `sglang:` metrics.

SGLang's `/metrics` (with `--enable-metrics`) serves every metric that any of its
processes wrote into PROMETHEUS_MULTIPROC_DIR. Metrics created here in the scheduler
process, after SGLang has set that variable, land in the same directory and so appear on
the same page with the `hack:` prefix. Gauges use `mostrecent` so the page shows the
latest sample of each server. `prometheus_client` is imported lazily because it picks
its storage (in memory or the multiprocess directory) when it is first imported.

Exported:
  hack:events_total{role,server,kind}            records seen, by kind
  hack:phase_seconds{role,server,phase}          histogram of phase durations
  hack:decode_step_seconds{role,server}          histogram of single decode steps
  hack:transfer_bytes_total{role,server}         KV bytes on the wire
  hack:transfer_bf16_bytes_total{role,server}    their BF16-equivalent size
  hack:output_tokens_total{role,server}          tokens reported by finish records
  hack:request_errors_total{role,server}
  hack:<sample field>{role,server}               the latest periodic sample (gauges):
      pages_used, pages_total, bytes_codes, bytes_side, bytes_tail, bytes_bf16,
      running, queued, rss_bytes, pages_selected, pages_visible (sparse decode)
  hack:kv_compression_ratio{role,server}         bytes_bf16 / (codes + side + tail)
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable

from hack_metrics import schema as S

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_MAX_OPEN = 100_000   # open start records remembered to pair with their end


class PrometheusExport:
    """Turns metrics records into prometheus_client metrics (one instance per registry)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        kw = {} if registry is None else {"registry": registry}
        labels = ["role", "server"]
        self.events = Counter("hack:events_total", "HACK metrics records by kind",
                              labels + ["kind"], **kw)
        self.phase_seconds = Histogram("hack:phase_seconds", "Request phase durations",
                                       labels + ["phase"], buckets=_BUCKETS, **kw)
        self.step_seconds = Histogram("hack:decode_step_seconds",
                                      "Duration of single decode steps", labels,
                                      buckets=_BUCKETS, **kw)
        self.transfer_bytes = Counter("hack:transfer_bytes_total",
                                      "KV bytes sent or received on the wire", labels, **kw)
        self.transfer_bf16 = Counter("hack:transfer_bf16_bytes_total",
                                     "BF16-equivalent size of the transferred KV", labels, **kw)
        self.output_tokens = Counter("hack:output_tokens_total",
                                     "Output tokens of finished requests", labels, **kw)
        self.errors = Counter("hack:request_errors_total", "Requests that failed", labels, **kw)
        self.gauges = {
            name: Gauge(f"hack:{name}", f"Latest periodic sample: {name}", labels,
                        multiprocess_mode="mostrecent", **kw)
            for name in S.SAMPLE_FIELDS
        }
        self.ratio = Gauge("hack:kv_compression_ratio",
                           "BF16-equivalent bytes over stored bytes (codes+side+tails)",
                           labels, multiprocess_mode="mostrecent", **kw)
        self._open: OrderedDict[tuple, int] = OrderedDict()
        self._seen: set[tuple[str, str]] = set()

    def _touch(self, role: str, server: str) -> None:
        """Export a server's counters at 0 from its first record on: a rate() over a counter
        that appears only with its first error or transfer misses that first increment, and
        a dashboard panel would show 'no data' rather than 0."""
        self._seen.add((role, server))
        for m in (self.transfer_bytes, self.transfer_bf16, self.output_tokens, self.errors):
            m.labels(role, server)

    def observe_rows(self, rows: Iterable[dict]) -> None:
        for row in rows:
            self._observe(row)

    def _observe(self, row: dict) -> None:
        role, server, kind = row["role"], row["server"], row["kind"]
        if (role, server) not in self._seen:
            self._touch(role, server)
        self.events.labels(role, server, kind).inc()
        if kind == "sample":
            self._sample(role, server, row)
            return
        phase, dur = row.get("phase"), row.get("dur_ns")
        if kind == "start":
            self._open[(server, row.get("rid"), row.get("room"), phase)] = row["t_ns"]
            while len(self._open) > _MAX_OPEN:
                self._open.popitem(last=False)
        elif kind == "end":
            t0 = self._open.pop((server, row.get("rid"), row.get("room"), phase), None)
            if dur is None and t0 is not None:
                dur = row["t_ns"] - t0
        if kind == "step":
            self.step_seconds.labels(role, server).observe(dur / 1e9)
        elif kind in ("span", "end") and dur is not None:
            self.phase_seconds.labels(role, server, phase).observe(dur / 1e9)
        if phase == "transfer" and kind in ("span", "end"):
            if row.get("bytes"):
                self.transfer_bytes.labels(role, server).inc(row["bytes"])
            if row.get("bytes_bf16"):
                self.transfer_bf16.labels(role, server).inc(row["bytes_bf16"])
        if kind == "finish" and row.get("tokens"):
            self.output_tokens.labels(role, server).inc(row["tokens"])
        if kind == "error":
            self.errors.labels(role, server).inc()

    def _sample(self, role: str, server: str, row: dict) -> None:
        for name, gauge in self.gauges.items():
            if row.get(name) is not None:
                gauge.labels(role, server).set(row[name])
        stored = sum(row.get(k) or 0 for k in ("bytes_codes", "bytes_side", "bytes_tail"))
        if stored > 0 and row.get("bytes_bf16"):
            self.ratio.labels(role, server).set(row["bytes_bf16"] / stored)


_DEFAULT: PrometheusExport | None = None


def default_export() -> PrometheusExport:
    """The process-wide exporter on prometheus_client's default registry."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = PrometheusExport()
    return _DEFAULT
