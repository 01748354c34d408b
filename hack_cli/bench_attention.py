"""`hack bench attention`: decode (and prefill) attention on this machine's CPU.

Methods, measured side by side in one run on the same context:
  hack     HACK attention on the 2-bit pages (hack_ops.paged: the compiled kernel when usable)
  bf16     torch SDPA over a contiguous BF16 cache (the exact baseline)
  dequant  the same 2-bit pages dequantized to BF16, then SDPA (the paper's strawman)
Decode: one query per request, batch x context, attention only (the store step that writes the
new token is not timed, for no method). Prefill: one prompt; hack = store + homomorphic
attention ('hack' and 'exact' prefill), bf16 = causal SDPA, dequant = store + causal SDPA.
Reported: the median of repeats per cell and speedups = baseline time / hack time.
Store rows (hack_ops.paged.benchstore): the store step alone, compiled page store vs the
PyTorch reference store, one layer of SmolLM2's KV shape, as GB/s of BF16 K/V input.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from hack_ops.config import HackConfig

SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # (query heads, kv heads, head_dim)


def register(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("attention", help="decode/prefill attention: HACK vs BF16 SDPA vs dequantize+SDPA")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true", help="contexts 2K and 8K, fewer repeats, short prefill")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--contexts", default=None, help="comma-separated token counts (default 2048,8192,32768)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per cell (default 5, quick 3)")
    p.add_argument("--prefill-tokens", type=int, default=None, help="prompt length (default 4096, quick 1024; 0: skip)")
    p.add_argument("--store-tokens", type=int, default=None,
                   help="prompt length of the store rows (default 7500, quick 2048; 0: skip them)")
    p.add_argument("--threads", type=int, default=None, help="torch/kernel threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time; cpu: this process's CPU time (with --threads 1, immune to "
                        "other processes on a shared machine)")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.set_defaults(func=run)


def run_default(args: argparse.Namespace) -> int:
    return run(argparse.Namespace(json=False, quick=False, shapes=",".join(SHAPES), batches="1,8",
                                  contexts=None, repeats=None, prefill_tokens=None, store_tokens=None, threads=None,
                                  clock="wall",
                                  out=None))


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) <= 0:
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return vals


def _median_ms(methods: dict, repeats: int, clock=time.perf_counter) -> dict[str, float]:
    """Median time per method; the methods take turns in every round, so a load change on a
    shared machine hits them alike."""
    for fn in methods.values():
        fn()  # warm-up (and first-use costs such as building the kernel)
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(repeats):
        for m, fn in methods.items():
            t0 = clock()
            fn()
            times[m].append((clock() - t0) * 1e3)
    return {m: statistics.median(t) for m, t in times.items()}


def run(args: argparse.Namespace) -> int:
    from hack_ops.paged import cpu_kernel

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        raise ValueError(f"unknown shapes {bad}; choose from {list(SHAPES)}")
    batches = _ints(args.batches, "--batches")
    contexts = _ints(args.contexts, "--contexts") if args.contexts else ([2048, 8192] if args.quick else [2048, 8192, 32768])
    repeats = args.repeats or (3 if args.quick else 5)
    prefill = args.prefill_tokens if args.prefill_tokens is not None else (1024 if args.quick else 4096)
    if repeats <= 0 or prefill < 0:
        raise ValueError("--repeats must be positive and --prefill-tokens non-negative")
    from hack_ops.paged.benchcases import decode_case, prefill_case

    if args.threads is not None:
        if args.threads <= 0:
            raise ValueError("--threads must be positive")
        torch.set_num_threads(args.threads)

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    results, ratios = [], []
    say = (lambda *a: None) if args.json else print
    say(f"attention on {_machine()}, {torch.get_num_threads()} threads, {args.clock} clock; "
        f"CPU kernel: {'AVX-512 VNNI' if cpu_kernel.simd() else ('plain C' if cpu_kernel.load() else 'unavailable')}")
    for shape in shapes:
        hq, h, d = SHAPES[shape]
        for batch in batches:
            for ctx in contexts:
                case = decode_case(hq, h, d, batch, ctx)
                cell = _median_ms(case.methods(), repeats, clock)
                case.release()
                for m, ms in cell.items():
                    results.append({"phase": "decode", "shape": shape, "batch": batch, "context": ctx, "method": m,
                                    "median_ms": round(ms, 4)})
                ratios.append({"phase": "decode", "shape": shape, "batch": batch, "context": ctx,
                               "hack_vs_bf16": round(cell["bf16"] / cell["hack"], 2),
                               "hack_vs_dequant": round(cell["dequant"] / cell["hack"], 2)})
                say(_row("decode", shape, batch, ctx, cell))
        if prefill:
            case = prefill_case(hq, h, d, prefill)
            cell = _median_ms(case.methods(), max(1, repeats // 2), clock)
            case.release()
            for m, ms in cell.items():
                results.append({"phase": "prefill", "shape": shape, "batch": 1, "context": prefill, "method": m,
                                "median_ms": round(ms, 4)})
            ratios.append({"phase": "prefill", "shape": shape, "batch": 1, "context": prefill,
                           "hack_vs_bf16": round(cell["bf16"] / cell["hack"], 2),
                           "hack_vs_dequant": round(cell["dequant"] / cell["hack"], 2)})
            say(_row("prefill", shape, 1, prefill, cell))
    store = _store_rows(args, repeats, clock, say)
    doc = {"machine": _machine(), "threads": torch.get_num_threads(), "clock": args.clock, "repeats": repeats,
           "kernel_simd": cpu_kernel.simd(), "results": results, "ratios": ratios, "store": store}
    if args.json:
        print(json.dumps(doc))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def _store_rows(args: argparse.Namespace, repeats: int, clock, say) -> list[dict]:
    """The store step: compiled page store vs the PyTorch store (SmolLM2: 3 KV heads x 64)."""
    from hack_ops.paged import benchstore, cpu_store
    from hack_ops.paged.store import HackKVStore

    tokens = getattr(args, "store_tokens", None)
    tokens = tokens if tokens is not None else (2048 if args.quick else 7500)
    if tokens < 0:
        raise ValueError("--store-tokens must be non-negative")
    if not tokens:
        return []
    _, h, d = SHAPES["smollm2"]
    why = cpu_store.why_not(HackKVStore(HackConfig(), 1, h, d, num_pages=1, num_rows=1))
    if why is not None:
        say(f"store rows skipped: the compiled store is not usable ({why})")
        return []
    rows = benchstore.store_rows(h, d, tokens, 8, repeats, clock)
    for r in rows:
        say(benchstore.format_row(r))
    return rows


def _row(phase: str, shape: str, batch: int, ctx: int, cell: dict) -> str:
    times = "  ".join(f"{m} {ms:9.2f} ms" for m, ms in cell.items())
    return (f"{phase:7s} {shape:9s} batch {batch:2d} context {ctx:6d}: {times}  "
            f"hack vs bf16 x{cell['bf16'] / cell['hack']:.2f}, vs dequant x{cell['dequant'] / cell['hack']:.2f}")


def _machine() -> str:
    name = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import os

    return f"{name}, {os.cpu_count()} CPUs"
