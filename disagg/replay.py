"""Replay a workload against a router (or any SGLang server) and time every request.

Each request is sent at its arrival offset on its own thread, streamed, and timed on the
client: TTFT = first streamed token, JCT = last byte. Greedy decoding, fixed output length
(ignore_eos) so every method generates the same number of tokens.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import requests

from engine.generate_stream import stream_chunks
from hack_eval.workloads import WorkItem


@dataclass
class Result:
    index: int
    prompt_tokens: int
    max_new_tokens: int
    ok: bool = False
    error: str | None = None
    status: int | None = None
    ttft_s: float | None = None
    jct_s: float | None = None
    output_ids: list[int] = field(default_factory=list)
    t_send: float = 0.0  # wall clock
    rid: str | None = None
    cached_tokens: int | None = None  # prompt tokens the server did not compute (SGLang's meta_info)
    cached_from_store: int | None = None  # of those, tokens restored from an external store (page tier)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["output_tokens"] = len(self.output_ids)
        d.pop("output_ids")
        return d


def generate(url: str, input_ids: list[int], max_new_tokens: int, timeout_s: float = 900.0,
             stream: bool = True, extra: dict | None = None) -> Result:
    """One greedy request to `url`/generate; never raises (errors land in the Result)."""
    res = Result(index=-1, prompt_tokens=len(input_ids), max_new_tokens=max_new_tokens)
    body = {"input_ids": input_ids, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                "ignore_eos": True}}
    body.update(extra or {})
    res.t_send = time.time()
    t0 = time.perf_counter()
    try:
        with requests.post(f"{url}/generate", json=body, stream=stream, timeout=timeout_s) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = r.text[:500]
                res.jct_s = time.perf_counter() - t0
                return res
            if not stream:
                data = r.json()
                res.output_ids = list(data.get("output_ids") or [])
                res.rid = (data.get("meta_info") or {}).get("id")
                _note_cached(res, data.get("meta_info") or {})
            else:
                for data in stream_chunks(r):
                    if "error" in data or data.get("object") == "error":
                        res.error = json.dumps(data)[:500]
                        break
                    ids = data.get("output_ids") or []
                    if ids and res.ttft_s is None:
                        res.ttft_s = time.perf_counter() - t0
                    res.output_ids = list(ids) if len(ids) >= len(res.output_ids) else res.output_ids + list(ids)
                    res.rid = (data.get("meta_info") or {}).get("id", res.rid)
                    _note_cached(res, data.get("meta_info") or {})
                    fr = (data.get("meta_info") or {}).get("finish_reason") or {}
                    if fr.get("type") == "abort":
                        res.error = fr.get("message") or "aborted"
    except requests.RequestException as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.jct_s = time.perf_counter() - t0
    res.ok = res.error is None and len(res.output_ids) > 0
    return res


def _note_cached(res: Result, meta: dict) -> None:
    if "cached_tokens" in meta:
        res.cached_tokens = int(meta["cached_tokens"])
    details = meta.get("cached_tokens_details")
    if isinstance(details, dict) and "host" in details:
        res.cached_from_store = int(details["host"])


def replay(url: str, items: list[WorkItem], timeout_s: float = 1800.0) -> list[Result]:
    """Send every item at its arrival offset; wait for all; results in item order."""
    results: list[Result | None] = [None] * len(items)

    def run(i: int, item: WorkItem) -> None:
        r = generate(url, item.input_ids, item.max_new_tokens, timeout_s)
        r.index = item.index
        results[i] = r

    start = time.perf_counter()
    threads = []
    for i, item in enumerate(items):
        delay = item.arrival_s - (time.perf_counter() - start)
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=run, args=(i, item), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout_s)
    return [r if r is not None else Result(items[i].index, len(items[i].input_ids),
                                           items[i].max_new_tokens, error="no response")
            for i, r in enumerate(results)]


def summarize(results: list[Result]) -> dict[str, Any]:
    import statistics

    ok = [r for r in results if r.ok]

    def stats(vals: list[float]) -> dict:
        if not vals:
            return {"mean": None, "p50": None, "p99": None}
        s = sorted(vals)
        p99 = s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]
        return {"mean": statistics.fmean(s), "p50": statistics.median(s), "p99": p99}

    return {"requests": len(results), "ok": len(ok),
            "jct_s": stats([r.jct_s for r in ok if r.jct_s is not None]),
            "ttft_s": stats([r.ttft_s for r in ok if r.ttft_s is not None])}
