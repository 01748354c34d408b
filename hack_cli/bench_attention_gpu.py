"""`hack bench attention --device cuda`: decode and prefill attention on a CUDA GPU.

HACK (the Triton kernels on 2-bit pages) vs the BF16 baseline (FlashInfer's paged kernels when
flashinfer imports, else torch SDPA with the flash backend on a contiguous cache; the JSON and
the table say which ran) vs dequantize-then-attend, all in one run, on the same context:
median time over CUDA events after warm-up (methods alternating, L2 flushed before every
call), the bytes each method must move, achieved bandwidth = bytes / time, and its fraction of
the device's copy bandwidth measured in the same run. Writes docs/bench/attention-cuda.json
and the table in docs/kernels.md (or only the JSON to --out).

Also runnable without the `hack` console script: python -m hack_cli.bench_attention_gpu [options]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hack_cli.bench_doc import DOCS, command_line, gpu_run_header, replace_block

GPU_SHAPES = {  # (query heads, kv heads, head_dim)
    "llama3-8b": (32, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
}
BATCHES = (1, 8, 32, 128)
CONTEXTS = (2048, 8192, 32768, 131072)
PREFILLS = (2048, 8192, 32768)
QUICK = {"batches": (1, 8), "contexts": (2048, 8192), "prefills": (2048,), "repeats": 5}
REPEATS, WARMUP = 20, 3
# Device memory a decode cell needs, in units of its BF16 KV size: the BF16 cache, the HACK
# pages (~0.2), the dequant path's BF16 copy and its temporaries (~2), the FlashInfer copy.
MEMORY_FACTOR = 3.5
JSON_OUT = DOCS / "bench" / "attention-cuda.json"
DOC = DOCS / "kernels.md"
DOC_BLOCK = "attention-cuda"
NO_CUDA = ("hack bench attention --device cuda needs a CUDA GPU, and torch sees none here "
           "(torch.cuda.is_available() is False); run it on a GPU machine, or use --device cpu")


@dataclass(frozen=True)
class Cell:
    phase: str  # 'decode' or 'prefill'
    shape: str
    batch: int
    context: int


def _ints(text: str | None, default: tuple[int, ...], what: str) -> tuple[int, ...]:
    if text is None:
        return default
    try:
        vals = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 0:
        raise ValueError(f"{what} must be non-negative integers, got {text!r}")
    return vals


def grid(args: argparse.Namespace) -> dict:
    """Shapes, batches, contexts, prefill lengths and repeats from the CLI (None = default)."""
    quick = bool(getattr(args, "quick", False))
    names = [s.strip() for s in args.shapes.split(",") if s.strip()] if args.shapes else list(GPU_SHAPES)
    bad = [s for s in names if s not in GPU_SHAPES]
    if bad:
        raise ValueError(f"unknown shapes {bad} for --device cuda; choose from {list(GPU_SHAPES)}")
    batches = _ints(args.batches, QUICK["batches"] if quick else BATCHES, "--batches")
    contexts = _ints(args.contexts, QUICK["contexts"] if quick else CONTEXTS, "--contexts")
    prefill = args.prefill_tokens
    prefills = _ints(None if prefill is None else str(prefill), QUICK["prefills"] if quick else PREFILLS,
                     "--prefill-tokens")
    prefills = tuple(n for n in prefills if n > 0)  # 0: no prefill rows
    if min(batches) <= 0 or min(contexts) <= 0:
        raise ValueError("--batches and --contexts must be positive")
    repeats = args.repeats or (QUICK["repeats"] if quick else REPEATS)
    if repeats <= 0:
        raise ValueError("--repeats must be positive")
    return {"shapes": names, "batches": batches, "contexts": contexts, "prefills": prefills, "repeats": repeats}


def plan_cells(g: dict, free_bytes: int, page_size: int = 64) -> tuple[list[Cell], list[dict]]:
    """Every (phase, shape, batch, context) cell that fits in `free_bytes` of device memory,
    and the skipped ones with the reason. Contexts must be whole pages (see DecodeCase)."""
    from hack_ops.triton.benchcases import AttnShape, bf16_kv_bytes

    cells, skipped = [], []
    for name in g["shapes"]:
        shape = AttnShape(name, *GPU_SHAPES[name])
        for batch in g["batches"]:
            for ctx in g["contexts"]:
                if ctx % page_size:
                    raise ValueError(f"--contexts must be multiples of the page size {page_size}, got {ctx}")
                need = MEMORY_FACTOR * bf16_kv_bytes(shape, batch * ctx)
                if need > free_bytes:
                    skipped.append({"phase": "decode", "shape": name, "batch": batch, "context": ctx,
                                    "reason": f"needs ~{need / 2**30:.0f} GiB, {free_bytes / 2**30:.0f} GiB free"})
                else:
                    cells.append(Cell("decode", name, batch, ctx))
        for n in g["prefills"]:
            cells.append(Cell("prefill", name, 1, n))
    return cells, skipped


def measure_cell(cell: Cell, baseline, device: torch.device, repeats: int, warmup: int, copy_bps: float,
                 flush) -> dict:
    """Time one cell's methods and return its row (times, bytes, bandwidths, ratios)."""
    from hack_ops.triton import benchcases as bc

    shape = bc.AttnShape(cell.shape, *GPU_SHAPES[cell.shape])
    if cell.phase == "decode":
        case = bc.DecodeCase(shape, cell.batch, cell.context, baseline, device)
    else:
        case = bc.PrefillCase(shape, cell.context, baseline, device)
    times = bc.median_ms(case.methods(), repeats, warmup, bc.Timer(device), flush)
    row = row_from(cell, times, case.bytes(), copy_bps)
    if cell.phase == "decode":
        row["max_abs_diff_hack_vs_dequant"] = round(bc.decode_max_abs_diff(case), 5)
    else:
        row["tflops"] = {m: round(bc.prefill_flops(cell.context, shape) / (ms * 1e-3) / 1e12, 2)
                         for m, ms in times.items()}
    case.release()
    return row


def row_from(cell: Cell, times: dict[str, float], nbytes: dict[str, int], copy_bps: float) -> dict:
    """A result row: per method median ms, bytes, GB/s and fraction of the copy bandwidth;
    speedups = baseline time / HACK time."""
    methods = {}
    for m, ms in times.items():
        bps = nbytes[m] / (ms * 1e-3)
        methods[m] = {"median_ms": round(ms, 4), "bytes": nbytes[m], "gb_per_s": round(bps / 1e9, 1),
                      "fraction_of_copy": round(bps / copy_bps, 3)}
    return {**asdict(cell), "methods": methods,
            "hack_vs_bf16": round(times["bf16"] / times["hack"], 2),
            "hack_vs_dequant": round(times["dequant"] / times["hack"], 2)}


def table(doc: dict) -> str:
    """The markdown the docs quote: header lines (device, date, command, baseline) and one row
    per cell."""
    lines = gpu_run_header(doc, f"triton {doc['triton']}, torch {doc['torch']}")
    lines += ["| phase | shape | batch | context | HACK ms | BF16 ms | dequant ms | vs BF16 | vs dequant "
             "| HACK GB/s (of copy) | BF16 GB/s (of copy) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        m = r["methods"]
        lines.append(f"| {r['phase']} | {r['shape']} | {r['batch']} | {r['context']} | {m['hack']['median_ms']:.3f} "
                     f"| {m['bf16']['median_ms']:.3f} | {m['dequant']['median_ms']:.3f} | x{r['hack_vs_bf16']:.2f} "
                     f"| x{r['hack_vs_dequant']:.2f} | {m['hack']['gb_per_s']:.0f} "
                     f"({100 * m['hack']['fraction_of_copy']:.0f}%) | {m['bf16']['gb_per_s']:.0f} "
                     f"({100 * m['bf16']['fraction_of_copy']:.0f}%) |")
    for s in doc.get("skipped", []):
        lines.append(f"| {s['phase']} | {s['shape']} | {s['batch']} | {s['context']} | skipped: {s['reason']} "
                     "| | | | | | |")
    return "\n".join(lines)


def check_device() -> torch.device:
    """The GPU to measure on, or a clear error (no GPU; Triton in interpreter mode)."""
    if not torch.cuda.is_available():
        raise RuntimeError(NO_CUDA)
    if os.environ.get("TRITON_INTERPRET", "").strip() not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: the kernels would run in Triton's CPU interpreter; unset it")
    return torch.device("cuda")


def run(args: argparse.Namespace) -> int:
    """`hack bench attention --device cuda`: measure, or with --from-json render a result."""
    if getattr(args, "model", None):
        raise ValueError("--model is CPU only; --device cuda measures its --shapes (llama3-8b, qwen2.5-7b)")
    if getattr(args, "from_json", None):
        return render_json(Path(args.from_json))
    return run_cuda(args)


def run_cuda(args: argparse.Namespace) -> int:
    if getattr(args, "clock", "wall") == "cpu" or getattr(args, "threads", None) is not None:
        raise ValueError("--clock and --threads apply to --device cpu; on CUDA the clock is CUDA events")
    g = grid(args)
    device = check_device()
    import triton

    from hack_ops.triton import benchcases as bc

    baseline = bc.choose_baseline(device, bc.flashinfer_importable())
    free, _ = torch.cuda.mem_get_info(device)
    cells, skipped = plan_cells(g, int(0.9 * free))
    say = (lambda *a: None) if args.json else print
    name = torch.cuda.get_device_name(device)
    flush = bc.l2_flush(device)
    copy_bps = bc.copy_bandwidth(device)
    say(f"attention on {name}: copy bandwidth {copy_bps / 1e9:.0f} GB/s; BF16 baseline: {baseline.value}")
    results = []
    out = Path(args.out) if args.out else JSON_OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    head = {"device": name, "capability": list(torch.cuda.get_device_capability(device)),
            "date": datetime.date.today().isoformat(), "command": getattr(args, "command_line", None) or command_line("attention"),
            "bf16_baseline": baseline.value, "dequant": "PyTorch-op dequantization to BF16, then SDPA (flash)",
            "triton": triton.__version__, "torch": torch.__version__, "repeats": g["repeats"], "warmup": WARMUP,
            "copy_bandwidth_gb_per_s": round(copy_bps / 1e9, 1)}
    for i, cell in enumerate(cells):
        row = measure_cell(cell, baseline, device, g["repeats"], WARMUP, copy_bps, flush)
        results.append(row)
        torch.cuda.empty_cache()
        # Written after every cell, so a run stopped early still leaves what it measured.
        partial = {**head, "complete": False, "cells_done": i + 1, "cells_planned": len(cells),
                   "results": results, "skipped": skipped}
        _write_json(out, partial)
        m = row["methods"]
        say(f"{cell.phase:7s} {cell.shape:10s} batch {cell.batch:3d} context {cell.context:6d}: "
            + "  ".join(f"{k} {v['median_ms']:8.3f} ms ({v['gb_per_s']:.0f} GB/s)" for k, v in m.items())
            + f"  hack vs bf16 x{row['hack_vs_bf16']:.2f}, vs dequant x{row['hack_vs_dequant']:.2f}")
    for s in skipped:
        say(f"skipped {s['phase']} {s['shape']} batch {s['batch']} context {s['context']}: {s['reason']}")
    doc = {**head, "complete": True, "results": results, "skipped": skipped}
    if args.json:
        print(json.dumps(doc))
    _write_json(out, doc)
    if not args.out:
        _write_doc_table(doc)
    return 0


def _write_json(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc, indent=1) + "\n")


def _write_doc_table(doc: dict) -> None:
    """docs/kernels.md's GPU table from a run's result (a fresh run, or one brought home)."""
    replace_block(DOC, DOC_BLOCK, table(doc), heading="### Measured on a GPU")


def render_json(path: Path) -> int:
    """The docs from a result a GPU run wrote with --out: the JSON under docs/bench and its table
    in docs/kernels.md (a GPU machine's output comes back as files; this needs no GPU)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--from-json: cannot read {path}: {exc}") from None
    missing = [k for k in ("device", "date", "command", "results", "copy_bandwidth_gb_per_s") if k not in doc]
    if missing:
        raise ValueError(f"--from-json: {path} is not a `--device cuda` result (missing {', '.join(missing)})")
    JSON_OUT.parent.mkdir(parents=True, exist_ok=True)
    _write_json(JSON_OUT, doc)
    _write_doc_table(doc)
    print(f"wrote {JSON_OUT} and the table in {DOC} ({len(doc['results'])} cells measured on {doc['device']})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`hack bench attention --device cuda` without the hack console script (a GPU machine with
    only torch and triton installed)."""
    from hack_cli.bench_attention_options import add_parser

    ap = argparse.ArgumentParser(prog="python -m hack_cli.bench_attention_gpu")
    sub = ap.add_subparsers(dest="bench")
    add_parser(sub, run)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(["attention", "--device", "cuda", *argv])
    args.command_line = " ".join(["python -m hack_cli.bench_attention_gpu", *argv])
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError) as exc:
        print(f"hack bench attention: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
