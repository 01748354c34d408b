"""The prefill a GPU server runs (`--hack-prefill auto` = dense: store, then flash attention) against
BF16 prefill: `python -m hack_cli.bench_prefill_cuda`.

Per cell (shape, prompt length), one fresh prompt, in one run on one GPU: the BF16 baseline
(`bf16`: FlashInfer's paged prefill when flashinfer imports, else torch SDPA's flash kernel on
contiguous K/V, causal; it writes no KV, the stronger baseline), the path `auto` picks with the CUDA
store (`auto_cuda`: hack_ops.cuda.store, then SDPA-flash) and with the Triton store
(`auto_triton`), and each store alone (`store_cuda`, `store_triton`). Median of CUDA-event timings
after warm-up, methods alternating, L2 flushed before every call (hack_ops.triton.benchcases). A
store's bandwidth is over its input (the prompt's BF16 K and V) against the device-to-device copy
bandwidth measured in the same run. Both stores' pages are compared byte for byte (the Triton store
sums a range candidate's errors in another order, so near-ties may differ). Targets
(docs/kernels.md, issue 33): auto >= 0.9x BF16, the store >= 50% of the copy bandwidth. The JSON is
rewritten after every cell; `--from-json FILE` renders a GPU run's file into docs/kernels.md here.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from hack_cli.bench_doc import gpu_bench_cli, gpu_run_header, render_gpu_run

SHAPES = {"llama3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128)}  # query heads, KV heads, head_dim
PROMPTS = (2048, 8192, 32768)
REPEATS, WARMUP = 20, 3
DOC_BLOCK = "prefill-cuda"
METHODS = ("bf16", "auto_cuda", "auto_triton", "store_cuda", "store_triton")
AUTO_VS_BF16 = 0.9
STORE_OF_COPY = 0.5


def measure(shape: str, n: int, baseline, device: torch.device, repeats: int, copy_bps: float, flush) -> dict:
    """One cell's row: per method median ms; ratios against BF16; the stores' bandwidth; whether
    the two stores wrote the same bytes."""
    from hack_ops.cuda.store import store as cuda_store
    from hack_ops.triton import benchcases as bc
    from hack_ops.triton.store import cache_kwargs, new_buffers
    from hack_ops.triton.store import store as triton_store

    s = bc.AttnShape(shape, *SHAPES[shape])
    case = bc.PrefillCase(s, n, baseline, device)  # its k/v (bf16 inputs: what a server stores), plan, buffers
    k, v = case.k.to(torch.bfloat16), case.v.to(torch.bfloat16)
    lay, batch = case.layout, case.step
    mine = new_buffers(lay, -(-n // lay.page_size), 1, 1, device=device)
    flash = bc.Baseline.SDPA_FLASH if baseline is bc.Baseline.FLASHINFER else baseline

    def store_cuda():
        cuda_store(lay, batch, k, v, **cache_kwargs(mine))

    def store_triton():
        triton_store(lay, batch, k, v, **cache_kwargs(case.bufs))

    def auto(store):
        def run():
            store()
            return bc._sdpa(flash, case.q4, case.k4, case.v4, causal=True)
        return run

    methods = {"bf16": case.run_bf16, "auto_cuda": auto(store_cuda), "auto_triton": auto(store_triton),
               "store_cuda": store_cuda, "store_triton": store_triton}
    times = bc.median_ms(methods, repeats, WARMUP, bc.Timer(device), flush)
    bc.Timer(device).sync()
    same = all(torch.equal(mine[name], case.bufs[name]) for name in ("k_buf", "v_buf", "sink_k", "sink_v"))
    # the Triton store sums a range candidate's errors in another order than the reference (and the
    # CUDA store): where two candidates tie to the last bit its page can differ
    differing = sum(int((mine[name] != case.bufs[name]).reshape(len(mine[name]), -1).any(-1).sum())
                    for name in ("k_buf", "v_buf"))
    store_bytes = 2 * n * s.kv_heads * s.head_dim * 2  # K and V in BF16: the store's input
    row = {"shape": shape, "prompt": n, "ms": {m: round(t, 4) for m, t in times.items()},
           "auto_cuda_vs_bf16": round(times["bf16"] / times["auto_cuda"], 3),
           "auto_triton_vs_bf16": round(times["bf16"] / times["auto_triton"], 3),
           "store_cuda_vs_triton": round(times["store_triton"] / times["store_cuda"], 2),
           "store_bytes": store_bytes,
           "store_cuda_gb_per_s": round(store_bytes / (times["store_cuda"] * 1e-3) / 1e9, 1),
           "store_cuda_of_copy": round(store_bytes / (times["store_cuda"] * 1e-3) / copy_bps, 3),
           "store_triton_gb_per_s": round(store_bytes / (times["store_triton"] * 1e-3) / 1e9, 1),
           "stores_identical": same, "pages_differing": differing, "pages": 2 * -(-n // lay.page_size)}
    row["targets"] = {"auto_ge_0.9x_bf16": row["auto_cuda_vs_bf16"] >= AUTO_VS_BF16,
                      "store_ge_half_copy_bw": row["store_cuda_of_copy"] >= STORE_OF_COPY}
    case.release()
    return row


def _differing(r: dict) -> str:
    if "pages_differing" not in r:
        return "none" if r["stores_identical"] else "some"
    return "none" if r["stores_identical"] else f"{r['pages_differing']}"


def table(doc: dict) -> str:
    lines = gpu_run_header(doc, f"torch {doc['torch']}, triton {doc['triton']}",
                           " (attention only, no KV written)")
    lines += ["| shape | prompt | BF16 ms | auto (CUDA store) ms | auto (Triton store) ms | CUDA store ms "
              "| Triton store ms | auto vs BF16 | CUDA store GB/s (of copy) | pages unlike the Triton store's | targets |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        ms = r["ms"]
        missed = [k for k, ok in r["targets"].items() if not ok]
        verdict = "met" if not missed else "missed: " + ", ".join(missed)
        lines.append(f"| {r['shape']} | {r['prompt']} | {ms['bf16']:.3f} | {ms['auto_cuda']:.3f} "
                     f"| {ms['auto_triton']:.3f} | {ms['store_cuda']:.3f} | {ms['store_triton']:.3f} "
                     f"| x{r['auto_cuda_vs_bf16']:.2f} | {r['store_cuda_gb_per_s']:.0f} "
                     f"({100 * r['store_cuda_of_copy']:.0f}%) | {_differing(r)} | {verdict} |")
    for f in doc.get("failed", []):
        lines.append(f"| {f['shape']} | {f['prompt']} | failed: {f['error']} | | | | | | | | |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise RuntimeError("bench_prefill_cuda needs a CUDA GPU, and torch sees none here")
    import triton

    from hack_ops.cuda.spec import device_why_not
    from hack_ops.triton import benchcases as bc

    device = torch.device("cuda")
    why = device_why_not(device)
    if why is not None:
        raise RuntimeError(f"the CUDA store cannot run here: {why}")
    shapes = [x for x in args.shapes.split(",") if x]
    bad = [x for x in shapes if x not in SHAPES]
    if bad:
        raise ValueError(f"unknown shapes {bad}; choose from {list(SHAPES)}")
    prompts = [int(x) for x in args.prompts.split(",") if x]
    if not prompts or min(prompts) <= 0:
        raise ValueError("--prompts must be positive integers")
    baseline = bc.choose_baseline(device, bc.flashinfer_importable())
    flush, copy_bps = bc.l2_flush(device), bc.copy_bandwidth(device)
    head = {"device": torch.cuda.get_device_name(device), "date": datetime.date.today().isoformat(),
            "command": args.command_line, "bf16_baseline": baseline.value, "torch": torch.__version__,
            "triton": triton.__version__, "repeats": args.repeats, "warmup": WARMUP,
            "copy_bandwidth_gb_per_s": round(copy_bps / 1e9, 1)}
    cells = [(s, n) for s in shapes for n in prompts]
    out, results = Path(args.out), []
    print(f"prefill on {head['device']}: copy bandwidth {copy_bps / 1e9:.0f} GB/s; BF16 baseline: {baseline.value}")
    failed = []
    for i, (s, n) in enumerate(cells):
        try:
            row = measure(s, n, baseline, device, args.repeats, copy_bps, flush)
        except Exception as exc:  # one cell's failure (a launch, memory) is recorded; the rest still run
            failed.append({"shape": s, "prompt": n, "error": f"{type(exc).__name__}: {exc}"})
            print(f"{s:10s} prompt {n:6d}: failed: {exc}", file=sys.stderr, flush=True)
            row = None
        else:
            results.append(row)
        torch.cuda.empty_cache()
        out.write_text(json.dumps({**head, "complete": i + 1 == len(cells), "cells_done": i + 1,
                                   "cells_planned": len(cells), "results": results, "failed": failed}, indent=1) + "\n")
        if row is not None:
            print(f"{s:10s} prompt {n:6d}: " + "  ".join(f"{m} {row['ms'][m]:.3f} ms" for m in METHODS)
                  + f"  auto vs bf16 x{row['auto_cuda_vs_bf16']:.2f}, store {row['store_cuda_gb_per_s']:.0f} GB/s"
                  + f" ({100 * row['store_cuda_of_copy']:.0f}% of copy), pages unlike the Triton store's "
                  f"{row['pages_differing']} of {row['pages']}")
    return 1 if failed else 0


def render_json(path: Path) -> int:
    """docs/bench/prefill-cuda.json and the table in docs/kernels.md from a GPU run's JSON."""
    return render_gpu_run(path, "bench_prefill_cuda", "prefill-cuda", DOC_BLOCK, table, "### GPU prefill measured")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hack_cli.bench_prefill_cuda", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--prompts", default=",".join(map(str, PROMPTS)), help="prompt lengths in tokens")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--out", default="prefill-cuda.json", help="the JSON, rewritten after every cell")
    ap.add_argument("--from-json", type=Path, help="render a GPU run's JSON into docs/kernels.md (no GPU)")
    return gpu_bench_cli(ap, argv, run, render_json)


if __name__ == "__main__":
    sys.exit(main())
