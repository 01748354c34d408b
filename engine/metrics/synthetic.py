"""Synthetic runs written through the real sink, for tests and for trying the dashboard.

The timings come from a small queueing model (one prefill server working first come
first served, one link, a decode server whose time per token grows with its batch), not
from a model being served. Runs are marked `"synthetic": true` in run.json and the
dashboard says so on every page. Their records go through `MetricsSink` exactly as a
server's would, so readers, joins and figures are exercised on real stream files.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hack_metrics import rundir
from engine.metrics.sink import MetricsSink

BF16_BYTES_PER_TOKEN = 23_040   # SmolLM2-135M: 30 layers x 3 KV heads x 64 x 2 (K,V) x 2 B
PAGE = 64


@dataclass
class SyntheticSpec:
    requests: int = 120
    kv_mode: str = "hack"          # hack | bf16 | dequant (a 2-bit dequantize baseline)
    link_mbit: float = 200.0
    rate_per_s: float = 0.5        # Poisson arrivals (the bf16 link saturates near 0.7/s)
    seed: int = 0
    error_every: int = 50          # every n-th request fails in transfer (0: never)
    step_records: int = 10         # the first n requests report every decode step
    sample_every_s: float = 0.5
    sparse_budget: int = 0         # > 0: the decode server runs sparse decode (pages read per step)
    page_tier: bool = False        # the prefill server runs a page tier: shared prefixes come back from it


def _wire_ratio(mode: str) -> float:
    # 2-bit codes + side tables at page 64 are ~16.4% of BF16 (DESIGN.md)
    return 1.0 if mode == "bf16" else 0.164


def write_synthetic_run(spec: SyntheticSpec, root: str | Path | None = None,
                        label: str | None = None, end_ns: int | None = None) -> Path:
    """Simulate `spec` and write a complete (closed) run directory; returns its path."""
    rng = np.random.default_rng(spec.seed)
    n = spec.requests
    gaps = rng.exponential(1.0 / spec.rate_per_s, n)
    arrive = np.cumsum(gaps)
    prompt = np.clip(rng.lognormal(7.2, 0.5, n), 64, 8192).astype(int)   # ~1.3K tokens
    outlen = rng.integers(8, 64, n)
    link_bps = spec.link_mbit * 1e6 / 8
    ratio = _wire_ratio(spec.kv_mode)

    rows = []   # (t_s, role, kind, idx, fields) simulated in seconds from run start
    pf_free = link_free = 0.0
    decode_busy: list[tuple[float, float]] = []
    for i in range(n):
        a = arrive[i]
        p_start = max(a, pf_free)
        p_dur = 2.0e-4 * prompt[i] + 2.0e-8 * prompt[i] ** 2
        if spec.kv_mode == "hack":
            p_dur *= 0.85           # INT8 matmuls in prefill (paper, Sec. 6.3)
        p_end = p_start + p_dur
        pf_free = p_end
        wire = int(prompt[i] * BF16_BYTES_PER_TOKEN * ratio)
        x_start = max(p_end, link_free)
        x_end = x_start + wire / link_bps
        link_free = x_end
        rows += [(a, "prefill", "arrival", i, {"tokens": int(prompt[i])}),
                 (a + 0.001, "decode", "arrival", i, {"tokens": int(prompt[i])}),
                 (a, "prefill", "start", i, {"phase": "queue"}),
                 (p_start, "prefill", "end", i, {"phase": "queue"}),
                 (p_start, "prefill", "start", i, {"phase": "prefill"}),
                 (p_end, "prefill", "end", i, {"phase": "prefill", "tokens": int(prompt[i]),
                                                **_prompt_sources(spec, i, int(prompt[i]))})]
        if spec.kv_mode != "bf16":
            q = p_dur * 0.03
            rows.append((p_end, "prefill", "span", i,
                         {"phase": "quantization", "dur_ns": int(q * 1e9),
                          "method": "attributed", "note": "synthetic: 3% of prefill"}))
        rows.append((x_start, "prefill", "start", i, {"phase": "transfer"}))
        if spec.error_every and (i + 1) % spec.error_every == 0:
            t_err = x_start + 0.5 * (x_end - x_start)
            rows += [(t_err, "prefill", "error", i, {"note": "synthetic: peer closed"}),
                     (t_err + 0.002, "decode", "error", i, {"note": "synthetic: transfer failed"})]
            continue
        rows.append((x_end, "prefill", "end", i, {"phase": "transfer", "bytes": wire,
                     "bytes_bf16": int(prompt[i] * BF16_BYTES_PER_TOKEN)}))
        rows.append((x_end, "prefill", "finish", i, {"tokens": 1}))
        d_start = x_end + 0.004
        active = sum(1 for s, e in decode_busy if s <= d_start < e)
        tpot = 0.030 * (1 + 0.08 * active) * (1.25 if spec.kv_mode == "dequant" else 1.0)
        d_end = d_start + tpot * int(outlen[i])
        decode_busy.append((d_start, d_end))
        rows.append((d_start + tpot, "decode", "first_token", i, {}))
        if i < spec.step_records:
            for k in range(int(outlen[i])):
                rows.append((d_start + (k + 1) * tpot, "decode", "step", i,
                             {"phase": "decode", "dur_ns": int(tpot * 1e9), "tokens": 1}))
        else:
            rows.append((d_end, "decode", "span", i, {
                "phase": "decode", "dur_ns": int((d_end - d_start) * 1e9),
                "tokens": int(outlen[i]), "method": "derived"}))
        if spec.kv_mode != "bf16":
            share = 0.03 if spec.kv_mode == "hack" else 0.20
            phase = "approximation" if spec.kv_mode == "hack" else "dequantization"
            rows.append((d_end, "decode", "span", i, {
                "phase": phase, "dur_ns": int((d_end - d_start) * share * 1e9),
                "method": "attributed", "note": f"synthetic: {share:.0%} of decode"}))
        rows.append((d_end, "decode", "finish", i, {"tokens": int(outlen[i])}))

    horizon = max(r[0] for r in rows)
    rows += _samples(spec, prompt, outlen, arrive, rows, horizon)
    rows.sort(key=lambda r: r[0])
    run = rundir.create_run(label or f"synthetic-{spec.kv_mode}", spec.kv_mode,
                            link_rate=f"{spec.link_mbit:g}mbit", root=root, synthetic=True)
    end_ns = end_ns or time.time_ns()
    t0 = end_ns - int(horizon * 1e9)
    sinks = {role: MetricsSink(run, role, "0", strict=True, flush_every=4096)
             for role in ("prefill", "decode")}
    for role in sinks:
        rundir.register_server(run, f"{role}-0", role)
    for t, role, kind, i, fields in rows:
        rid = None if i is None else f"{role[0]}{i:05d}"
        room = None if i is None else 7_000_000 + i
        sinks[role].record(kind, rid, room=room, t_ns=t0 + int(t * 1e9), **fields)
    for s in sinks.values():
        s.close()
    rundir.mark_finished(run)
    return run


def _samples(spec: SyntheticSpec, prompt, outlen, arrive, rows, horizon) -> list:
    """Pool contents every `sample_every_s` on both servers, from the simulated spans."""
    # The prefill server holds a request's KV until its transfer ends; decode until finish.
    end = {"prefill": np.full(len(prompt), horizon), "decode": np.full(len(prompt), horizon)}
    for t, role, kind, i, f in rows:
        if kind == "error" or (kind == "finish" and role == "decode") or \
                (kind == "end" and f.get("phase") == "transfer"):
            end[role][i] = min(end[role][i], t)
    ratio_codes = 0.125 if spec.kv_mode != "bf16" else 1.0
    ratio_side = 0.039 if spec.kv_mode != "bf16" else 0.0
    out = []
    for t in np.arange(0.0, horizon + spec.sample_every_s, spec.sample_every_s):
        for role in ("prefill", "decode"):
            live = (arrive <= t) & (t < end[role])
            tokens = prompt[live] + (outlen[live] if role == "decode" else 0)
            full_tokens = int((tokens // PAGE * PAGE).sum())
            tail_tokens = int(tokens.sum()) - full_tokens
            if spec.kv_mode == "bf16":
                full_tokens, tail_tokens = full_tokens + tail_tokens, 0
            bf16 = (full_tokens + tail_tokens) * BF16_BYTES_PER_TOKEN
            n_live = int(live.sum())
            out.append((float(t), role, "sample", None, {
                "pages_used": (full_tokens + tail_tokens + PAGE - 1) // PAGE,
                "pages_total": 4096, "running": n_live if role == "decode" else 0,
                "queued": 0 if role == "decode" else max(n_live - 1, 0),
                "bytes_codes": int(full_tokens * BF16_BYTES_PER_TOKEN * ratio_codes),
                "bytes_side": int(full_tokens * BF16_BYTES_PER_TOKEN * ratio_side),
                "bytes_tail": int(tail_tokens * BF16_BYTES_PER_TOKEN),
                "bytes_bf16": bf16, "rss_bytes": 900_000_000 + bf16 // 4,
                **_sparse_sample(spec, role, tokens), **_tier_sample(spec, role, float(t), arrive, prompt)}))
    return out


def _prompt_sources(spec: SyntheticSpec, i: int, prompt: int) -> dict:
    """With a page tier: every third request shares a cached prefix of half its prompt (whole
    pages), restored from the tier after the first few requests, else found in the pool."""
    if not spec.page_tier:
        return {}
    cached = prompt // 2 // PAGE * PAGE if i % 3 == 0 else 0
    return {"cached_tokens": cached, "restored_tokens": cached if i >= 6 else 0}


def _tier_sample(spec: SyntheticSpec, role: str, t: float, arrive: np.ndarray, prompt: np.ndarray) -> dict:
    """The prefill server's tier: every request so far wrote its pages; a third asked and found half."""
    if not spec.page_tier or role != "prefill":
        return {}
    seen = arrive <= t
    pages = prompt[seen] // PAGE
    return {"tier_bytes": int(pages.sum()) * PAGE * BF16_BYTES_PER_TOKEN * 19 // 100,
            "tier_asked_pages": int(pages.sum()), "tier_hit_pages": int(pages[::3].sum() // 2)}


def _sparse_sample(spec: SyntheticSpec, role: str, tokens: np.ndarray) -> dict:
    """A decode server with sparse decode: per step and sparse layer, the closed pages read
    (at most the budget per request) beside the closed pages a dense step reads."""
    if spec.sparse_budget <= 0 or role != "decode" or not len(tokens):
        return {}
    closed = tokens // PAGE
    return {"pages_visible": int(closed.sum()),
            "pages_selected": int(np.minimum(closed, max(2, spec.sparse_budget // PAGE)).sum())}
