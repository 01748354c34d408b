"""`hack bench attention`: decode (and prefill) attention on this machine's CPU.

Methods, measured side by side in one run on the same context:
  hack     HACK attention on the 2-bit pages (hack_ops.paged: the compiled kernel when usable)
  bf16     torch SDPA over a contiguous BF16 cache (the exact baseline)
  dequant  the same 2-bit pages dequantized to BF16, then SDPA (the paper's strawman)
Decode: one query per request, batch x context, attention only (the store step that writes the
new token is not timed, for no method). Prefill: one prompt per length; hack = store +
homomorphic attention ('hack', 'exact' and 'int8' prefill: hack-exact, hack-int8 rows), hack-attn =
the homomorphic attention alone on stored pages, hack-store = the store alone, bf16 / fp32 =
causal SDPA (the baseline is the faster of the two), dequant = store + causal SDPA.
Reported: the median of repeats per cell, speedups = baseline time / hack time, the extend path
that ran, and a roofline measured in the same run (copy bandwidth, INT8/BF16/FP32 GEMM peaks)
with each kernel's achieved fraction of it.
Store rows (hack_ops.paged.benchstore): the store step alone, compiled page store vs the
PyTorch reference store, one layer of SmolLM2's KV shape, as GB/s of BF16 K/V input.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from hack_ops.config import HackConfig
from hack_ops.modes import AttentionMode

from .bench_attention_options import SHAPES, add_parser


def model_attention_shape(name: str) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) from a prepared model's config.json (prepared once
    when missing), so `--model gemma3` measures Gemma-3's 4 x 1 x 256 layers."""
    from hack_eval.models import model_dir, prepare

    folder = model_dir(name)
    if not (folder / "config.json").is_file():
        folder = prepare(name, log=lambda m: print(m, file=sys.stderr))
    cfg = json.loads((folder / "config.json").read_text())
    hq = cfg["num_attention_heads"]
    return hq, cfg.get("num_key_value_heads", hq), cfg.get("head_dim") or cfg["hidden_size"] // hq


def register(bsub: argparse._SubParsersAction) -> None:
    add_parser(bsub, run)


def run_default(args: argparse.Namespace) -> int:
    return run(argparse.Namespace(json=False, quick=False, shapes=",".join(SHAPES), model=None, batches="1,8",
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
    if getattr(args, "device", "cpu") == "cuda":
        from hack_cli.bench_attention_gpu import run as run_gpu

        return run_gpu(args)
    if getattr(args, "from_json", None):
        raise ValueError("--from-json renders a GPU run's result: use it with --device cuda")
    from hack_ops.paged import cpu_kernel

    known = dict(SHAPES)
    model = getattr(args, "model", None)
    if model:
        known[model] = model_attention_shape(model)
    # --model alone measures that model; with --shapes, both.
    default = model if model and not args.shapes else ",".join(SHAPES)
    shapes = [s.strip() for s in (args.shapes or default).split(",") if s.strip()]
    if model and model not in shapes:
        shapes.append(model)
    bad = [s for s in shapes if s not in known]
    if bad:
        raise ValueError(f"unknown shapes {bad}; choose from {list(known)}")
    batches = _ints(args.batches or "1,8", "--batches")
    contexts = _ints(args.contexts, "--contexts") if args.contexts else ([2048, 8192] if args.quick else [2048, 8192, 32768])
    repeats = args.repeats or (3 if args.quick else 5)
    ptext = str(args.prefill_tokens) if args.prefill_tokens is not None else ("1024" if args.quick else "2048,8192,16384")
    prefills = [] if ptext.strip() == "0" else _ints(ptext, "--prefill-tokens")
    if repeats <= 0:
        raise ValueError("--repeats must be positive")
    from hack_ops.paged.benchcases import decode_case, prefill_case

    if args.threads is not None:
        if args.threads <= 0:
            raise ValueError("--threads must be positive")
        torch.set_num_threads(args.threads)

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    results, ratios = [], []
    say = (lambda *a: None) if args.json else print
    from hack_ops.paged import cpu_extend

    say(f"attention on {_machine()}, {torch.get_num_threads()} threads, {args.clock} clock; "
        f"CPU kernel: {'AVX-512 VNNI' if cpu_kernel.simd() else ('plain C' if cpu_kernel.load() else 'unavailable')}"
        f"{' (extend: AVX2)' if cpu_extend.tiled_path() == cpu_extend.ExtendPath.AVX2 else ''}")
    roof = roofline(clock)
    say("roofline: " + ", ".join(f"{k} {v}" for k, v in roof.items()))
    extend_path = None
    for shape in shapes:
        hq, h, d = known[shape]
        for batch in batches:
            for ctx in contexts:
                case = decode_case(hq, h, d, batch, ctx)
                cell = _median_ms(case.methods(), repeats, clock)
                read = batch * case.store.layout.page_bytes * (ctx // case.store.page_size)  # closed pages
                case.release()
                for m, ms in cell.items():
                    results.append({"phase": "decode", "shape": shape, "batch": batch, "context": ctx, "method": m,
                                    "median_ms": round(ms, 4)})
                ratios.append({"phase": "decode", "shape": shape, "batch": batch, "context": ctx,
                               "hack_vs_bf16": round(cell["bf16"] / cell["hack"], 2),
                               "hack_vs_dequant": round(cell["dequant"] / cell["hack"], 2),
                               "_bytes": read, "_hack_ms": cell["hack"]})
                say(_row("decode", shape, batch, ctx, cell))
        for prefill in prefills:
            case = prefill_case(hq, h, d, prefill)
            extend_path = cpu_extend.describe(case.store, AttentionMode.HACK)
            say(f"extend path: {extend_path}")
            cell = _median_ms(case.methods(), max(1, repeats // 2), clock)
            store_bytes = case.store.layout.page_bytes * -(-prefill // case.store.page_size)
            case.release()
            for m, ms in cell.items():
                results.append({"phase": "prefill", "shape": shape, "batch": 1, "context": prefill, "method": m,
                                "median_ms": round(ms, 4)})
            base = "bf16" if cell["bf16"] <= cell["fp32"] else "fp32"
            macs = 2 * hq * d * prefill * (prefill + 1) / 2  # Q.K and P.V, causal
            ratios.append({"phase": "prefill", "shape": shape, "batch": 1, "context": prefill, "baseline": base,
                           "hack_vs_bf16": round(cell["bf16"] / cell["hack"], 2),
                           "hack_vs_dequant": round(cell["dequant"] / cell["hack"], 2),
                           "hack_vs_baseline": round(cell[base] / cell["hack"], 2),
                           "hack_attn_vs_baseline": round(cell[base] / cell["hack-attn"], 2),
                           "hack_attn_int8_peak_frac": round(2 * macs / (cell["hack-attn"] * 1e6) / roof["int8_gops"], 3)
                           if roof["int8_gops"] else None,
                           "baseline_gemm_peak_frac": round(2 * macs / (cell[base] * 1e6) / roof[f"{base}_gops"], 3),
                           "store_input_gb_s": round(4 * prefill * h * d / (cell["hack-store"] * 1e6), 3),
                           "store_output_bytes": store_bytes})
            say(_row("prefill", shape, 1, prefill, cell, base))
    for r in ratios:  # decode: bytes of pages read per second against the copy bandwidth
        if r["phase"] == "decode":
            r["hack_copy_bw_frac"] = round(r.pop("_bytes") / (r.pop("_hack_ms") * 1e6) / roof["copy_gb_s"], 3)
    store = _store_rows(args, repeats, clock, say)
    from .bench_doc import command_line

    doc = {"command": command_line("attention", getattr(args, "argv", None)), "date": time.strftime("%Y-%m-%d"), "machine": _machine(),
           "threads": torch.get_num_threads(), "clock": args.clock, "repeats": repeats,
           "kernel_simd": cpu_kernel.simd(), "extend_path": extend_path, "roofline": roof, "results": results,
           "ratios": ratios, "store": store}
    if args.json:
        print(json.dumps(doc))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    if getattr(args, "doc", False):
        from .bench_attention_doc import write

        write(doc, doc["command"], doc["date"])
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


def _row(phase: str, shape: str, batch: int, ctx: int, cell: dict, base: str = "bf16") -> str:
    times = "  ".join(f"{m} {ms:9.2f} ms" for m, ms in cell.items())
    extra = f", hack-attn vs {base} x{cell[base] / cell['hack-attn']:.2f}" if "hack-attn" in cell else ""
    return (f"{phase:7s} {shape:9s} batch {batch:2d} context {ctx:6d}: {times}  "
            f"hack vs {base} x{cell[base] / cell['hack']:.2f}, vs dequant x{cell['dequant'] / cell['hack']:.2f}{extra}")


ROOFLINE_SIZES = (512, 1024, 2048)
ROOFLINE_BUDGET_S = 0.5


def roofline(clock=time.perf_counter, repeats: int = 3) -> dict:
    """This machine's copy bandwidth (GB/s, read + write of a 256 MiB tensor) and GEMM peaks
    (GOPS of n^3 matmuls, n growing up to 2048 while one product takes under ROOFLINE_BUDGET_S;
    torch._int_mm for INT8 when it runs on this CPU, else None). A dtype without a fast path
    stops at a small n: on an AVX2-only EPYC a 2048^3 BF16 matmul ran at 0.3 GOPS, about a minute
    a product, and the fixed 2048 made this measurement 5 minutes long."""
    def best(fn) -> float:
        fn()
        return min(_timed(fn, clock) for _ in range(repeats))

    def gops(product) -> float:
        rate = 0.0
        for n in ROOFLINE_SIZES:
            t = best(product(n))
            rate = 2 * n ** 3 / t / 1e9
            if t > ROOFLINE_BUDGET_S:
                break
        return round(rate, 1)

    src = torch.empty(64 * 2 ** 20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    out = {"copy_gb_s": round(2 * src.numel() * 4 / best(lambda: dst.copy_(src)) / 1e9, 2)}

    def matmul(dt):
        def product(n):
            x = torch.randn(n, n).to(dt)
            return lambda: x @ x
        return product

    def int_mm(n):
        x8 = torch.randint(-64, 64, (n, n), dtype=torch.int8)
        return lambda: torch._int_mm(x8, x8)

    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        out[f"{name}_gops"] = gops(matmul(dt))
    try:
        out["int8_gops"] = gops(int_mm)
    except RuntimeError:
        out["int8_gops"] = None  # torch._int_mm has no CPU kernel in this build
    return out


def _timed(fn, clock) -> float:
    t0 = clock()
    fn()
    return clock() - t0


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
