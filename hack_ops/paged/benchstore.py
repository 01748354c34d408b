"""Store-step benchmark rows for `hack bench attention`: the compiled page store against the
PyTorch reference store, one layer, on the same plan and the same BF16 K/V.

Throughput is GB/s of K/V input: the BF16 bytes of the new tokens' K and V (2 tensors x N x
H x D x 2 bytes) over the store step's time. Cases:
  prefill         one prompt of `tokens` tokens (every page but the last closes)
  decode-append   one token for each of `batch` requests, no page closes (FP16 tail appends:
                  'auto' takes the two-index-write path)
  decode-close    one token for each of `batch` requests, each closing its page
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from ..config import HackConfig
from .fill import scattered_table
from .store import HackKVStore, StoreBackend


def _case(h: int, d: int, lens: list[int], ext: list[int], seed: int = 0):
    cfg = HackConfig()
    p = cfg.partition_size
    pages = sum(-(-n // p) for n in lens) + 1
    store = HackKVStore(cfg, 1, h, d, num_pages=pages, num_rows=len(lens))
    g = torch.Generator().manual_seed(seed)
    rows = list(range(len(lens)))
    table = scattered_table(lens, p, len(lens), rows, pages, generator=g)
    pre = [n - e for n, e in zip(lens, ext)]
    if any(pre):  # the cached prefix, stored once (not timed)
        kp = torch.randn(sum(pre), h, d, generator=g).to(torch.bfloat16)
        store.write(0, store.plan(table, rows, pre, pre), kp, kp)
    plan = store.plan(table, rows, lens, ext)
    chan = 1.0 + (torch.arange(d) % 7).float()
    k = (torch.randn(sum(ext), h, d, generator=g) * chan).to(torch.bfloat16)
    v = torch.randn(sum(ext), h, d, generator=g).to(torch.bfloat16)
    return store, plan, k, v


def _median_ms(fns: dict[str, Callable[[], None]], repeats: int, clock) -> dict[str, float]:
    for fn in fns.values():
        fn()  # warm-up (builds the library on first use)
    times: dict[str, list[float]] = {m: [] for m in fns}
    for _ in range(repeats):  # methods alternate, so load changes hit them alike
        for m, fn in fns.items():
            t0 = clock()
            fn()
            times[m].append((clock() - t0) * 1e3)
    return {m: statistics.median(t) for m, t in times.items()}


def store_rows(h: int, d: int, tokens: int, batch: int, repeats: int, clock=time.perf_counter) -> list[dict]:
    """One row per case: median ms and GB/s per method, and compiled-vs-torch speedup."""
    context = 8192
    cases = {
        "prefill": ([tokens], [tokens], ("cpu", "torch")),
        "decode-append": ([context + 5] * batch, [1] * batch, ("auto", "torch")),
        "decode-close": ([context] * batch, [1] * batch, ("cpu", "torch")),
    }
    rows = []
    for name, (lens, ext, methods) in cases.items():
        store, plan, k, v = _case(h, d, lens, ext)
        fns = {m: (lambda m=m: store.write(0, plan, k, v, backend=StoreBackend(m))) for m in methods}
        cell = _median_ms(fns, repeats if name != "prefill" else max(1, repeats // 2 + 1), clock)
        nbytes = 2 * k.numel() * 2  # BF16 K and V
        fast = methods[0]
        rows.append({
            "case": name, "tokens": int(k.shape[0]), "kv_heads": h, "head_dim": d,
            "input_bytes": nbytes,
            "ms": {m: round(t, 4) for m, t in cell.items()},
            "gb_per_s": {m: round(nbytes / (t * 1e-3) / 1e9, 4) for m, t in cell.items()},
            "speedup": round(cell["torch"] / cell[fast], 2), "fast": fast,
        })
    return rows


def format_row(r: dict) -> str:
    parts = "  ".join(f"{m} {r['ms'][m]:9.3f} ms {r['gb_per_s'][m]:7.3f} GB/s" for m in r["ms"])
    return (f"store   {r['case']:14s} {r['tokens']:5d} tokens, {r['kv_heads']} heads x {r['head_dim']}: {parts}  "
            f"{r['fast']} vs torch x{r['speedup']:.2f}")
