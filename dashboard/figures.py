"""Plotly figures of a run (and of two runs side by side). Used by the Streamlit app and
by the operator notebook, so both show the same thing.

Every phase has one color everywhere (PHASE_COLORS). Figures never draw more than a
bounded number of marks: the timeline and the per-request breakdown show a window of the
newest requests, memory series are downsampled (hack_metrics.analysis.memory_series).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from hack_metrics import analysis
from hack_metrics.run_view import RunView

PHASE_COLORS = {
    "queue": "#9e9e9e", "prefill": "#1f77b4", "quantization": "#ff7f0e",
    "transfer": "#2ca02c", "approximation": "#9467bd", "dequantization": "#d62728",
    "decode": "#17becf", "other": "#d9d9d9",
}
PHASE_LABELS = {
    "queue": "queue", "prefill": "prefill", "quantization": "quantization",
    "transfer": "KV transfer", "approximation": "approximation",
    "dequantization": "dequantization", "decode": "decode", "other": "other (waiting)",
}
# Drawing order in the timeline: phases that run inside another one go on top, thinner.
_GANTT_ORDER = ("queue", "transfer", "prefill", "decode", "quantization", "approximation",
                "dequantization")
_NESTED = {"quantization", "approximation", "dequantization"}
# Stacking order of the breakdown: the paper's Fig. 10 order, then the extras.
STACK_ORDER = ("prefill", "quantization", "transfer", "approximation", "dequantization",
               "decode", "queue", "other")
MEMORY_PARTS = (("bytes_codes", "2-bit codes", "#1f77b4"),
                ("bytes_side", "side tables", "#ff7f0e"),
                ("bytes_tail", "FP16 tails", "#2ca02c"))

TITLES = {
    "timeline": "Request timeline",
    "breakdown": "Phase breakdown per request",
    "average": "Average JCT breakdown (Fig. 10)",
    "memory": "KV cache memory over time",
    "compression": "KV compression ratio",
    "throughput": "Throughput",
    "latency": "Latency percentiles (TTFT, TPOT, JCT)",
    "servers": "Requests and process memory",
    "tier": "Page tier: prefixes restored from disk",
}
TIER_PARTS = (("restored", "restored from the page tier", "#2ca02c"),
              ("pooled", "from the pool (radix cache)", "#1f77b4"),
              ("computed", "computed", "#d9d9d9"))


def _empty(title: str, why: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, height=260, xaxis_visible=False, yaxis_visible=False)
    fig.add_annotation(text=why, showarrow=False, x=0.5, y=0.5, xref="paper",
                       yref="paper", font_size=14)
    return fig


def window(view: RunView, max_requests: int) -> pd.DataFrame:
    """The newest `max_requests` requests by arrival (in-flight ones included)."""
    req = view.requests.dropna(subset=["arrival_ns"])
    return req.tail(max_requests)


def _labels(req: pd.DataFrame) -> dict:
    """Axis label per request key: the user-facing request id (decode side) if known."""
    def one(row: dict) -> str:
        for col in ("rid_decode", "rid_colocated", "rid_prefill"):
            if isinstance(row.get(col), str):
                return row[col][:24]
        return row["key"]
    out = {row["key"]: one(row) for row in req.to_dict("records")}
    if len(set(out.values())) < len(out):      # ids reused across servers: use the keys
        out = {k: k for k in out}
    return out


def timeline_figure(view: RunView, max_requests: int = 200) -> go.Figure:
    """Gantt chart: one row per request, one colored bar per phase interval."""
    title = TITLES["timeline"]
    req = window(view, max_requests)
    if not len(req):
        return _empty(title, "no requests yet")
    labels = _labels(req)
    spans = view.spans[view.spans["key"].isin(labels)]
    t0 = view.t0_ns
    fig = go.Figure()
    for phase in _GANTT_ORDER:
        s = spans[spans["phase"] == phase]
        if not len(s):
            continue
        start = (s["start_ns"] - t0).to_numpy(np.float64) / 1e9
        dur = (s["end_ns"] - s["start_ns"]).to_numpy(np.float64) / 1e9
        hover = [f"{labels[k]} · {PHASE_LABELS[phase]} · {role}<br>{st:.3f}s → {st + d:.3f}s "
                 f"({d * 1e3:.1f} ms){' · no end record' if o else ''}"
                 for k, role, st, d, o in zip(s["key"], s["role"], start, dur, s["open"])]
        fig.add_trace(go.Bar(
            y=[labels[k] for k in s["key"]], x=dur, base=start, orientation="h",
            name=PHASE_LABELS[phase], marker_color=PHASE_COLORS[phase],
            width=0.35 if phase in _NESTED else 0.8, hovertext=hover, hoverinfo="text",
            legendgroup=phase))
    ft = req.dropna(subset=["first_token_ns"])
    if len(ft):
        fig.add_trace(go.Scatter(
            y=[labels[k] for k in ft["key"]],
            x=(ft["first_token_ns"] - t0).to_numpy(np.float64) / 1e9, mode="markers",
            name="first token", marker=dict(symbol="diamond", size=7, color="black")))
    err = req[req["status"] == "error"]
    if len(err):
        last = view.spans[view.spans["key"].isin(err["key"])].groupby("key")["end_ns"].max()
        x = [(last.get(k, a) - t0) / 1e9 for k, a in zip(err["key"], err["arrival_ns"])]
        fig.add_trace(go.Scatter(
            y=[labels[k] for k in err["key"]], x=x, mode="markers", name="error",
            hovertext=err["error"].astype(str).tolist(),
            marker=dict(symbol="x", size=10, color="#d62728")))
    shown = f" (newest {len(req)} of {len(view.requests)})" \
        if len(view.requests) > len(req) else ""
    fig.update_layout(title=title + shown, barmode="overlay", xaxis_title="seconds since run start",
                      height=min(1400, 160 + 14 * len(req)), legend_orientation="h",
                      legend_y=-0.08 if len(req) > 30 else -0.25)
    fig.update_yaxes(categoryorder="array", categoryarray=list(labels.values())[::-1],
                     showticklabels=len(req) <= 60)
    return fig


def breakdown_figure(view: RunView, max_requests: int = 200) -> go.Figure:
    """Stacked exclusive phase times of each finished request in the window."""
    title = TITLES["breakdown"]
    b = view.breakdown
    keys = set(window(view, max_requests)["key"])
    b = b[b["key"].isin(keys)]
    if not len(b):
        return _empty(title, "no finished requests yet")
    labels = _labels(view.requests[view.requests["key"].isin(b["key"])])
    x = [labels[k] for k in b["key"]]
    fig = go.Figure()
    for phase in STACK_ORDER:
        y = b[phase].to_numpy()
        if not y.any():
            continue
        fig.add_trace(go.Bar(x=x, y=y, name=PHASE_LABELS[phase],
                             marker_color=PHASE_COLORS[phase], legendgroup=phase))
    fig.update_layout(title=f"{title} (seconds; each bar sums to its JCT)", barmode="stack",
                      yaxis_title="seconds", height=420, bargap=0.1)
    fig.update_xaxes(showticklabels=len(b) <= 60, title="request (by arrival)")
    return fig


def average_breakdown_figure(views: dict[str, RunView], legend: bool = True) -> go.Figure:
    """One stacked bar per run: mean seconds per phase, labelled with its share of JCT."""
    title = TITLES["average"]
    avgs = {name: analysis.average_breakdown(v.breakdown) for name, v in views.items()
            if len(v.breakdown)}
    if not avgs:
        return _empty(title, "no finished requests yet")
    names = list(avgs)
    fig = go.Figure()
    for phase in STACK_ORDER:
        y = np.array([avgs[n][phase] for n in names])
        if not y.any():
            continue
        totals = np.array([avgs[n].sum() for n in names])
        share = [f"{100 * a / t:.1f}%" if t > 0 and a / t >= 0.02 else "" for a, t in
                 zip(y, totals)]
        fig.add_trace(go.Bar(x=names, y=y, name=PHASE_LABELS[phase], text=share,
                             textposition="inside", marker_color=PHASE_COLORS[phase],
                             legendgroup=phase,
                             hovertemplate="%{x}: %{y:.3f} s<extra>" + PHASE_LABELS[phase]
                             + "</extra>"))
    fig.update_layout(title=title, barmode="stack", yaxis_title="mean seconds per request",
                      height=420, showlegend=legend)
    return fig


def memory_figure(view: RunView, max_points: int = 1500) -> go.Figure:
    """Per server: stacked bytes in codes / side tables / tails vs the BF16 equivalent; with
    sparse decode, the closed pages a decode step read per sparse layer beside the pages a dense
    step reads there (right axis)."""
    title = TITLES["memory"]
    mem = analysis.memory_series(view.samples, view.t0_ns, max_points)
    if not len(mem):
        return _empty(title, "no memory samples yet")
    servers = list(dict.fromkeys(mem["server"]))
    # sparse decode or static eviction: the pages a decode step read beside those it would read
    # dense (right axis)
    sparse = bool(mem["pages_selected"].notna().any())
    fig = make_subplots(rows=len(servers), cols=1, shared_xaxes=True,
                        subplot_titles=servers, vertical_spacing=0.08,
                        specs=[[{"secondary_y": sparse}] for _ in servers])
    parts = MEMORY_PARTS
    if view.data.meta.get("kv_mode") == "bf16":     # a BF16 pool reports its KV as codes
        parts = (("bytes_codes", "BF16 KV", MEMORY_PARTS[0][2]),) + MEMORY_PARTS[1:]
    for row, server in enumerate(servers, start=1):
        m = mem[mem["server"] == server]
        for col, name, color in parts:
            fig.add_trace(go.Scatter(x=m["t_s"], y=m[col] / 2**20, name=name, stackgroup=f"s{row}",
                                     line_color=color, legendgroup=name,
                                     showlegend=row == 1), row=row, col=1)
        fig.add_trace(go.Scatter(x=m["t_s"], y=m["bytes_bf16"] / 2**20,
                                 name="BF16 equivalent", line=dict(color="black", dash="dash"),
                                 legendgroup="bf16", showlegend=row == 1), row=row, col=1)
        fig.update_yaxes(title_text="MiB", row=row, col=1)
        if sparse:
            for col, name, dash in (("pages_visible", "pages a dense decode step reads", "dot"),
                                    ("pages_selected", "pages the step read (sparse / static eviction)", "solid")):
                fig.add_trace(go.Scatter(x=m["t_s"], y=m[col], name=name, mode="lines",
                                         line=dict(color="#8c564b", dash=dash), legendgroup=col,
                                         showlegend=row == 1), row=row, col=1, secondary_y=True)
            fig.update_yaxes(title_text="pages per step and layer", row=row, col=1, secondary_y=True)
    fig.update_xaxes(title_text="seconds since run start", row=len(servers), col=1)
    fig.update_layout(title=title, height=220 + 220 * len(servers))
    return fig


def compression_figure(view: RunView, max_points: int = 1500) -> go.Figure:
    """Pool ratio over time per server, and the ratio on the wire as a reference line."""
    title = TITLES["compression"]
    mem = analysis.memory_series(view.samples, view.t0_ns, max_points)
    wire = analysis.wire_ratio(view.requests)
    if not len(mem.dropna(subset=["ratio"])) and wire is None:
        return _empty(title, "no samples or transfers with byte counts yet")
    fig = go.Figure()
    for server, m in mem.groupby("server", sort=False):
        fig.add_trace(go.Scatter(x=m["t_s"], y=m["ratio"], name=f"{server} pool",
                                 mode="lines"))
    if wire is not None:
        fig.add_hline(y=wire, line_dash="dot", annotation_text=f"on the wire: {wire:.2f}x")
    fig.update_layout(title=f"{title} (BF16-equivalent bytes / stored bytes)",
                      yaxis_title="x smaller than BF16", xaxis_title="seconds since run start",
                      height=320, yaxis_rangemode="tozero")
    return fig


def throughput_figure(view: RunView) -> go.Figure:
    title = TITLES["throughput"]
    tp = analysis.throughput(view.requests, view.t0_ns)
    if not len(tp):
        return _empty(title, "no finished requests yet")
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=tp["t_s"], y=tp["tokens_per_s"], name="output tokens/s",
                         marker_color="#17becf"))
    fig.add_trace(go.Scatter(x=tp["t_s"], y=tp["requests_per_s"], name="requests/s",
                             mode="lines+markers", line_color="#1f77b4"), secondary_y=True)
    fig.update_yaxes(title_text="tokens/s", secondary_y=False)
    fig.update_yaxes(title_text="requests/s", secondary_y=True, rangemode="tozero")
    fig.update_layout(title=title + " (by finish time)", height=320,
                      xaxis_title="seconds since run start")
    return fig


def latency_figure(views: dict[str, RunView], qs: tuple = (50, 90, 99)) -> go.Figure:
    """TTFT / TPOT / JCT percentiles, one panel each, one bar group per run."""
    title = TITLES["latency"]
    tables = {n: analysis.latency_percentiles(v.requests, qs).set_index("metric")
              for n, v in views.items()}
    if all(t["count"].sum() == 0 for t in tables.values()):
        return _empty(title, "no finished requests yet")
    metrics = ("TTFT", "TPOT", "JCT")
    fig = make_subplots(rows=1, cols=3, subplot_titles=[f"{m} (s)" for m in metrics])
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")
    for i, (name, t) in enumerate(tables.items()):
        for c, metric in enumerate(metrics, start=1):
            y = [t.loc[metric, f"p{q:g}"] for q in qs]
            fig.add_trace(go.Bar(x=[f"p{q:g}" for q in qs], y=y, name=name,
                                 marker_color=palette[i % len(palette)], legendgroup=name,
                                 showlegend=c == 1), row=1, col=c)
    fig.update_layout(title=title, barmode="group", height=340)
    return fig


def servers_figure(view: RunView, max_points: int = 1500) -> go.Figure:
    """Running / queued requests and RSS per server."""
    title = TITLES["servers"]
    mem = analysis.memory_series(view.samples, view.t0_ns, max_points)
    if not len(mem):
        return _empty(title, "no samples yet")
    fig = make_subplots(rows=1, cols=2, subplot_titles=["requests", "RSS (MiB)"])
    for server, m in mem.groupby("server", sort=False):
        fig.add_trace(go.Scatter(x=m["t_s"], y=m["running"], name=f"{server} running",
                                 mode="lines"), row=1, col=1)
        fig.add_trace(go.Scatter(x=m["t_s"], y=m["queued"], name=f"{server} queued",
                                 mode="lines", line_dash="dot"), row=1, col=1)
        fig.add_trace(go.Scatter(x=m["t_s"], y=m["rss_bytes"] / 2**20, name=f"{server} RSS",
                                 mode="lines"), row=1, col=2)
    fig.update_layout(title=title, height=320)
    return fig


def has_tier(view: RunView) -> bool:
    """Whether the run's servers ran with a page tier (`--hack-page-tier`)."""
    sam = view.samples
    return bool(len(sam) and "tier_bytes" in sam and sam["tier_bytes"].notna().any())


def tier_figure(view: RunView, max_requests: int = 200, max_points: int = 1500) -> go.Figure:
    """The page tier: per server its bytes on disk and hit rate (pages found / pages asked for)
    over time; per request (newest first in the window) where its prompt came from."""
    title = TITLES["tier"]
    mem = analysis.memory_series(view.samples, view.t0_ns, max_points)
    mem = mem.dropna(subset=["tier_bytes"]) if len(mem) else mem
    if not len(mem):
        return _empty(title, "no page tier in this run (servers without --hack-page-tier)")
    req = window(view, max_requests).dropna(subset=["cached_tokens"])
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.18, specs=[[{"secondary_y": True}], [{}]],
                        subplot_titles=["tier size and hit rate", "prompt tokens per request, by source"])
    for server, m in mem.groupby("server", sort=False):
        fig.add_trace(go.Scatter(x=m["t_s"], y=m["tier_bytes"] / 2**20, name=f"{server} on disk (MiB)",
                                 mode="lines"), row=1, col=1)
        rate = 100 * m["tier_hit_pages"] / m["tier_asked_pages"].where(m["tier_asked_pages"] > 0)
        fig.add_trace(go.Scatter(x=m["t_s"], y=rate, name=f"{server} hit rate (%)", mode="lines",
                                 line_dash="dot"), row=1, col=1, secondary_y=True)
    fig.update_yaxes(title_text="MiB", row=1, col=1)
    fig.update_yaxes(title_text="% of pages asked for", range=[0, 100], row=1, col=1, secondary_y=True)
    if len(req):
        labels = _labels(req)
        x = [labels[k] for k in req["key"]]
        restored = req["restored_tokens"].fillna(0).to_numpy(np.float64)
        cached = req["cached_tokens"].to_numpy(np.float64)
        parts = {"restored": restored, "pooled": np.maximum(cached - restored, 0),
                 "computed": np.maximum(req["prompt_tokens"].to_numpy(np.float64) - cached, 0)}
        for col, name, color in TIER_PARTS:
            fig.add_trace(go.Bar(x=x, y=parts[col], name=name, marker_color=color), row=2, col=1)
        fig.update_xaxes(showticklabels=len(req) <= 60, title="request (by arrival)", row=2, col=1)
        fig.update_yaxes(title_text="tokens", row=2, col=1)
    fig.update_layout(title=title, barmode="stack", height=620)
    return fig
