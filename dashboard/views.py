"""Streamlit page sections: one run, or two runs side by side."""
from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from dashboard import figures as F
from dashboard.sources import Source
from hack_metrics import analysis
from hack_metrics.run_view import RunView


@st.cache_resource(max_entries=16, show_spinner=False)
def get_source(target: str, kind: str, servers: tuple[str, ...] = ()) -> Source:
    """One incremental loader per run directory or URL, shared by all browser tabs."""
    return Source(target, kind, servers)


def _chart(fig, key: str) -> None:
    st.plotly_chart(fig, width="stretch", key=key, config={"displaylogo": False})


def show_problems(view: RunView) -> None:
    """Tell the user what is missing, partial, damaged or of an unknown version."""
    data = view.data
    for msg in data.warnings:
        st.warning(msg, icon=":material/warning:")
    for msg in view.notes:
        st.info(msg, icon=":material/info:")
    if not data.has_data:
        st.warning("No metrics records to show for this run yet.", icon=":material/warning:")


def header(view: RunView) -> None:
    meta = view.data.meta
    title = meta.get("label") or view.data.source
    st.subheader(title)
    facts = [f"KV mode: **{meta.get('kv_mode', '?')}**",
             f"link: **{meta.get('link_rate') or 'unshaped'}**"]
    if meta.get("model"):
        facts.append(f"model: **{meta['model']}**")
    if meta.get("created"):
        facts.append(f"started {meta['created']}")
    facts += [f"source: `{view.data.source}`",
             "**live**" if view.data.live else "finished" if meta.get("finished")
             else "not live"]
    servers = meta.get("servers") or []
    if servers:
        facts.append("servers: " + ", ".join(
            f"{s.get('id')}" + (f" ({s['url']})" if s.get("url") else "") for s in servers))
    st.markdown(" · ".join(facts))
    if meta.get("command"):
        st.caption(f"`{meta['command']}`")
    if meta.get("synthetic"):
        st.info("Synthetic run: these timings come from a queueing model written through "
                "the metrics sink, not from serving a model.", icon=":material/science:")


def _fmt_s(x: float) -> str:
    if x is None or not np.isfinite(x):
        return "–"
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def kpis(view: RunView) -> None:
    req = view.requests
    status = req["status"].value_counts() if len(req) else pd.Series(dtype=int)
    pct = analysis.latency_percentiles(req).set_index("metric")
    # Pool ratio over the whole run: every sample weighs the same (samples are periodic).
    mem = analysis.memory_series(view.samples, view.t0_ns, 10**9)
    stored, bf16 = mem["stored"].sum(), mem["bytes_bf16"].fillna(0).sum()
    fin = view.finished
    dur = (fin["finish_ns"].max() - view.t0_ns) / 1e9 if len(fin) else 0
    tokens = pd.to_numeric(fin["output_tokens"], errors="coerce").sum() if len(fin) else 0
    wire = analysis.wire_ratio(req)
    cols = st.columns(7)
    cols[0].metric("finished", f"{status.get('finished', 0)}")
    cols[1].metric("in flight / errors",
                   f"{status.get('in_flight', 0)} / {status.get('error', 0)}")
    cols[2].metric("TTFT p50", _fmt_s(pct.loc["TTFT", "p50"]))
    cols[3].metric("TPOT p50", _fmt_s(pct.loc["TPOT", "p50"]))
    cols[4].metric("JCT p50", _fmt_s(pct.loc["JCT", "p50"]))
    cols[5].metric("output tokens/s", f"{tokens / dur:.1f}" if dur > 0 else "–")
    cols[6].metric("KV compression", f"{bf16 / stored:.2f}x" if stored > 0 and bf16 > 0
                   else "–", f"wire {wire:.2f}x" if wire else None, delta_color="off",
                   help="pool: BF16-equivalent over stored bytes, averaged over the "
                        "samples; wire: the same for transferred KV")


def run_page(view: RunView, max_requests: int, key: str = "run") -> None:
    header(view)
    show_problems(view)
    if not view.data.has_data:
        return
    kpis(view)
    _chart(F.timeline_figure(view, max_requests), f"{key}-timeline")
    left, right = st.columns([5, 2])
    with left:
        _chart(F.breakdown_figure(view, max_requests), f"{key}-breakdown")
    with right:
        _chart(F.average_breakdown_figure({view.data.meta.get("label") or "this run": view},
                                          legend=False), f"{key}-average")
    _chart(F.memory_figure(view), f"{key}-memory")
    if F.has_tier(view):
        _chart(F.tier_figure(view, max_requests), f"{key}-tier")
    left, right = st.columns(2)
    with left:
        _chart(F.compression_figure(view), f"{key}-compression")
    with right:
        _chart(F.throughput_figure(view), f"{key}-throughput")
    left, right = st.columns(2)
    with left:
        _chart(F.latency_figure({"this run": view}), f"{key}-latency")
        st.dataframe(analysis.latency_percentiles(view.requests).round(4), hide_index=True)
    with right:
        _chart(F.servers_figure(view), f"{key}-servers")
    with st.expander("Requests (newest first)"):
        cols = ["key", "status", "prompt_tokens", "cached_tokens", "restored_tokens", "output_tokens", "ttft_s", "tpot_s",
                "jct_s", "bytes", "bytes_bf16", "roles", "error"]
        req = view.requests
        st.dataframe(req[[c for c in cols if c in req]].iloc[::-1].head(max_requests),
                     hide_index=True)


def compare_page(views: dict[str, RunView]) -> None:
    """Two runs side by side (e.g. bf16 vs hack), with shared charts for the contrasts."""
    names = list(views)
    cols = st.columns(len(names))
    for col, name in zip(cols, names):
        with col:
            header(views[name])
            show_problems(views[name])
    rows = []
    for name, v in views.items():
        p = analysis.latency_percentiles(v.requests).set_index("metric")
        avg = analysis.average_breakdown(v.breakdown)
        rows.append({"run": name, "finished": len(v.finished),
                     "errors": int((v.requests["status"] == "error").sum()),
                     "TTFT p50 s": p.loc["TTFT", "p50"], "TPOT p50 s": p.loc["TPOT", "p50"],
                     "JCT p50 s": p.loc["JCT", "p50"], "mean JCT s": avg.sum(),
                     "mean transfer s": avg["transfer"],
                     "wire ratio": analysis.wire_ratio(v.requests)})
    st.dataframe(pd.DataFrame(rows).round(4), hide_index=True)
    _chart(F.average_breakdown_figure(views), "cmp-average")
    _chart(F.latency_figure(views), "cmp-latency")
    cols = st.columns(len(names))
    for i, (col, name) in enumerate(zip(cols, names)):
        with col:
            _chart(F.memory_figure(views[name]), f"cmp-memory-{i}")
            _chart(F.compression_figure(views[name]), f"cmp-compression-{i}")
