"""Numbers the dashboard and the benchmarks show: breakdown, percentiles, throughput,
memory. Inputs are the frames of `hack_metrics.join`; outputs are plain DataFrames.

Breakdown (the paper's Fig. 10): each instant between a request's arrival and its finish
goes to exactly one phase — the first active one in `schema.EXCLUSIVE_PRIORITY`
(fused quantization/approximation before the prefill/decode that contain them, compute
before an overlapping transfer, anything before queueing); instants covered by no
phase are `other` (e.g. waiting for the decode server to admit the request). So the
phases of a request add up to its JCT exactly, and a phase's share is the time it adds
to the JCT. `phase_totals` gives the raw (overlapping) durations instead.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from hack_metrics.schema import EXCLUSIVE_PRIORITY, SAMPLE_FIELDS

BREAKDOWN_PHASES = EXCLUSIVE_PRIORITY + ("other",)
_RANK = {p: i for i, p in enumerate(EXCLUSIVE_PRIORITY)}


def exclusive_breakdown(spans: pd.DataFrame, requests: pd.DataFrame) -> pd.DataFrame:
    """Seconds per phase for each finished request; rows sum to `jct_s`."""
    fin = requests[requests["status"] == "finished"].dropna(subset=["arrival_ns",
                                                                    "finish_ns"])
    cols = {p: np.zeros(len(fin)) for p in BREAKDOWN_PHASES}
    by_key = {k: g for k, g in spans.groupby("key")} if len(spans) else {}
    for i, (key, t0, t1) in enumerate(zip(fin["key"], fin["arrival_ns"], fin["finish_ns"])):
        t0, t1 = int(t0), int(t1)
        g = by_key.get(key)
        if g is None or t1 <= t0:
            cols["other"][i] = max(t1 - t0, 0) / 1e9
            continue
        s = np.clip(g["start_ns"].to_numpy(np.int64), t0, t1)
        e = np.clip(g["end_ns"].to_numpy(np.int64), t0, t1)
        rank = np.array([_RANK.get(p, len(_RANK)) for p in g["phase"]])
        bounds = np.unique(np.concatenate([s, e, [t0, t1]]))
        lo, hi = bounds[:-1], bounds[1:]
        active = (s[:, None] <= lo[None, :]) & (e[:, None] >= hi[None, :]) & \
                 (e > s)[:, None]
        ranks = np.where(active, rank[:, None], len(_RANK))
        winner = ranks.min(axis=0)
        seg = (hi - lo) / 1e9
        for r, phase in enumerate(EXCLUSIVE_PRIORITY):
            cols[phase][i] = seg[winner == r].sum()
        cols["other"][i] = seg[winner >= len(_RANK)].sum()
    out = pd.DataFrame(cols)
    out.insert(0, "key", fin["key"].to_numpy())
    out["jct_s"] = (fin["finish_ns"].to_numpy() - fin["arrival_ns"].to_numpy()) / 1e9
    out["arrival_ns"] = fin["arrival_ns"].to_numpy()
    return out


def average_breakdown(breakdown: pd.DataFrame) -> pd.Series:
    """Mean seconds per phase over finished requests (the paper's average JCT bars)."""
    if not len(breakdown):
        return pd.Series(0.0, index=list(BREAKDOWN_PHASES))
    return breakdown[list(BREAKDOWN_PHASES)].mean()


def phase_totals(spans: pd.DataFrame) -> pd.DataFrame:
    """Raw seconds per (request, phase), overlaps not removed; bytes per transfer."""
    if not len(spans):
        return pd.DataFrame(columns=["key", "phase", "seconds"])
    d = spans.assign(seconds=(spans["end_ns"] - spans["start_ns"]) / 1e9)
    return d.groupby(["key", "phase"], as_index=False)["seconds"].sum()


def latency_percentiles(requests: pd.DataFrame,
                        qs: tuple[float, ...] = (50, 90, 99)) -> pd.DataFrame:
    """TTFT / TPOT / JCT percentiles (seconds) over finished requests."""
    fin = requests[requests["status"] == "finished"] if len(requests) else requests
    rows = []
    for metric in ("ttft_s", "tpot_s", "jct_s"):
        vals = pd.to_numeric(fin[metric], errors="coerce").dropna().to_numpy() \
            if metric in fin else np.array([])
        row = {"metric": metric[:-2].upper(), "count": int(vals.size),
               "mean": float(vals.mean()) if vals.size else np.nan}
        for q in qs:
            row[f"p{q:g}"] = float(np.percentile(vals, q)) if vals.size else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def throughput(requests: pd.DataFrame, t0_ns: int, bin_s: float | None = None
               ) -> pd.DataFrame:
    """Output tokens/s and finished requests/s per time bin (by finish time)."""
    fin = requests[requests["status"] == "finished"] if len(requests) else requests
    if not len(fin):
        return pd.DataFrame(columns=["t_s", "tokens_per_s", "requests_per_s"])
    t = (fin["finish_ns"] - t0_ns).to_numpy(np.float64) / 1e9
    span = max(float(t.max()), 1e-9)
    if bin_s is None:
        bin_s = max(1.0, span / 60)
    # floor + 1 bins always reach past the last finish (arange can stop just short of it).
    edges = np.arange(int(np.floor(span / bin_s)) + 2) * bin_s
    tok = pd.to_numeric(fin["output_tokens"], errors="coerce").fillna(0).to_numpy()
    tokens, _ = np.histogram(t, bins=edges, weights=tok)
    count, _ = np.histogram(t, bins=edges)
    return pd.DataFrame({"t_s": edges[:-1] + bin_s / 2, "tokens_per_s": tokens / bin_s,
                         "requests_per_s": count / bin_s})


def memory_series(samples: pd.DataFrame, t0_ns: int, max_points: int = 1500
                  ) -> pd.DataFrame:
    """Per-server samples with `t_s` and `ratio`; at most `max_points` per server.

    Longer series are cut into `max_points` equal time buckets keeping each bucket's
    maximum (memory peaks are what an operator must see).
    """
    cols = ["server", "t_s", *SAMPLE_FIELDS, "stored", "ratio"]
    if not len(samples):
        return pd.DataFrame(columns=cols)
    parts = []
    for server, g in samples.groupby("server"):
        g = g.sort_values("t_ns")
        d = pd.DataFrame({"t_s": (g["t_ns"] - t0_ns).to_numpy(np.float64) / 1e9})
        for f in SAMPLE_FIELDS:
            d[f] = pd.to_numeric(g[f], errors="coerce").to_numpy(np.float64)
        if len(d) > max_points:
            lo, hi = d["t_s"].iloc[0], d["t_s"].iloc[-1]
            bucket = np.minimum(((d["t_s"] - lo) / max(hi - lo, 1e-9) * max_points)
                                .astype(int), max_points - 1)
            d = d.groupby(bucket).max()
        d.insert(0, "server", server)
        parts.append(d)
    out = pd.concat(parts, ignore_index=True)
    out["stored"] = out[["bytes_codes", "bytes_side", "bytes_tail"]].fillna(0).sum(axis=1)
    out["ratio"] = (out["bytes_bf16"] / out["stored"]).where(out["stored"] > 0)
    return out[cols]


def wire_ratio(requests: pd.DataFrame) -> float | None:
    """BF16-equivalent bytes over bytes on the wire, over all transfers (None if unknown)."""
    if "bytes" not in requests or not len(requests):
        return None
    sent = pd.to_numeric(requests["bytes"], errors="coerce").sum()
    bf16 = pd.to_numeric(requests["bytes_bf16"], errors="coerce").sum()
    return float(bf16 / sent) if sent > 0 and bf16 > 0 else None
