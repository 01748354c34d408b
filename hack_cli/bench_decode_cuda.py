"""The CUDA decode kernel against BF16 decode on a GPU: `python -m hack_cli.bench_decode_cuda`.

Per cell (shape, batch, context), in one run on one GPU: the CUDA kernel on the pool's pages
(`cuda`, token order) and on the same pages in fragment order (`cuda_fragment`), with a 3-page
cp.async ring per warp instead of 2 (`cuda_stages3`, token order), the Triton
kernel on the same pages (`triton`), and the BF16 baseline (`bf16`: FlashInfer's paged decode when
flashinfer imports, else torch SDPA's flash backend on a contiguous cache, as
hack_cli.bench_attention_gpu). Median of CUDA-event timings after warm-up, methods alternating,
L2 flushed before every call (hack_ops.triton.benchcases); bytes each method must read; achieved
bandwidth against the device-to-device copy bandwidth measured in the same run; the issue-33
targets (docs/kernels.md) checked per cell. The JSON is rewritten after every cell, so a run
stopped at its time limit keeps what it measured; `--from-json FILE` renders a GPU run's file into
docs/kernels.md here, with no GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hack_cli.bench_doc import gpu_bench_cli, gpu_run_header, render_gpu_run

SHAPES = {"llama3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128)}  # query heads, KV heads, head_dim
BATCHES = (1, 8, 32, 128)
CONTEXTS = (2048, 8192, 32768)
REPEATS, WARMUP = 20, 3
MEMORY_FACTOR = 2.4  # device memory per cell in units of its BF16 KV: the cache (twice while FlashInfer copies it), the pages twice
DOC_BLOCK = "decode-cuda"
METHODS = ("cuda", "cuda_fragment", "triton", "bf16")


@dataclass(frozen=True)
class Cell:
    shape: str
    batch: int
    context: int


def targets(cell: Cell, speedup: float, fraction: float) -> dict[str, bool | None]:
    """Issue 33's decode targets for one cell (None: the target does not apply to it)."""
    return {
        "ge_1x": speedup >= 1.0,
        "ge_3x_batch8_8k": speedup >= 3.0 if cell.batch >= 8 and cell.context >= 8192 else None,
        "ge_4x_32k": speedup >= 4.0 if cell.context >= 32768 else None,
        "ge_half_copy_bw_32k": fraction >= 0.5 if cell.context >= 32768 else None,
    }


def cuda_decode_bytes(layout, seq_lens: list[int], q_heads: int) -> int:
    """What the CUDA kernel reads: per closed page K's and V's codes, minimum and scale (not K's
    code sums, which FP16 arithmetic does not need), the FP16 open partition and sinks, the queries."""
    from hack_ops.triton.benchcases import hack_decode_bytes

    sums = layout.k.sums.nbytes
    return hack_decode_bytes(layout, seq_lens, q_heads) - sum(n // layout.page_size for n in seq_lens) * sums


def select_bytes(layout, seq_lens: list[int], q_heads: int) -> int:
    """What the device selection reads: K's minimum and scale of every closed page and KV head, the queries."""
    lay, p = layout, layout.page_size
    meta = lay.k.minimum.nbytes + lay.k.scale.nbytes
    return sum(n // p for n in seq_lens) * meta + len(seq_lens) * q_heads * lay.head_dim * 2


class CudaCell:
    """One cell's data and methods: benchcases.DecodeCase (pages by the Triton store, the BF16
    cache, the Triton kernel) plus the CUDA kernel on its pages and on a fragment-order copy; with
    sparse budgets, per budget the device selection (hack_ops.triton.sparse) and both kernels over
    its per-head tables (planned once: the plan's host checks are not timed)."""

    def __init__(self, cell: Cell, baseline, device: torch.device, budgets: tuple[int, ...] = ()) -> None:
        from hack_ops.cuda import CodeOrder, CudaDecodeAttention
        from hack_ops.cuda.fragment import convert_pages
        from hack_ops.triton import benchcases as bc

        hq, h, d = SHAPES[cell.shape]
        self.case = bc.DecodeCase(bc.AttnShape(cell.shape, hq, h, d), cell.batch, cell.context, baseline, device)
        b = self.case.hack.batch
        self.cuda = {}
        self.frag_bufs = {k: v for k, v in self.case.bufs.items()}
        self.frag_bufs["k_buf"] = self.case.bufs["k_buf"].clone()
        self.frag_bufs["v_buf"] = self.case.bufs["v_buf"].clone()
        convert_pages(self.case.layout, self.frag_bufs["k_buf"], self.frag_bufs["v_buf"], CodeOrder.FRAGMENT)
        for order in CodeOrder:
            att = CudaDecodeAttention(self.case.layout, hq, order=order)
            att.plan(b.kv_indptr, b.kv_indices, b.seq_lens, b.tail_rows, b.sink_slots)
            self.cuda[order] = att
        # the 3-page ring (Variant.stages), token order: what a deeper pipeline buys on this card
        self.stages3 = CudaDecodeAttention(self.case.layout, hq, stages=3)
        self.stages3.plan(b.kv_indptr, b.kv_indices, b.seq_lens, b.tail_rows, b.sink_slots)
        self.out = torch.empty_like(self.case.q)
        self.splits = self.cuda[CodeOrder.TOKEN].splits(None)
        self.sparse = {bud: self._sparse(bud) for bud in budgets}

    def _sparse(self, budget: int) -> dict:
        from hack_ops.cuda import CudaDecodeAttention
        from hack_ops.sparse import SparseConfig
        from hack_ops.triton.decode import HackDecodeAttention
        from hack_ops.triton.sparse import select_head_tables

        c, b = self.case, self.case.hack.batch
        cfg = SparseConfig(budget_tokens=budget, dense_layers=0)

        def select():
            return select_head_tables(c.layout, c.bufs["k_buf"], c.table, c.seq_lens, c.q, cfg)

        indptr, indices, lens = select()
        kernels = {}
        for name, cls in (("cuda", CudaDecodeAttention), ("triton", HackDecodeAttention)):
            att = cls(c.layout, c.shape.q_heads)
            att.plan(indptr, indices, lens, b.tail_rows, b.sink_slots, head_tables=True)
            kernels[name] = att
        return {"select": select, "kernels": kernels, "seq_lens": lens.tolist()}

    def methods(self) -> dict:
        from hack_ops.cuda import CodeOrder
        from hack_ops.triton.store import cache_kwargs

        q, case = self.case.q, self.case
        tok, frag = cache_kwargs(case.bufs), cache_kwargs(self.frag_bufs)
        methods = {"cuda": lambda: self.cuda[CodeOrder.TOKEN].run(q, **tok, out=self.out),
                   "cuda_fragment": lambda: self.cuda[CodeOrder.FRAGMENT].run(q, **frag, out=self.out),
                   "cuda_stages3": lambda: self.stages3.run(q, **tok, out=self.out),
                   "triton": case.run_hack, "bf16": case.run_bf16}
        for bud, sp in self.sparse.items():
            methods[f"select_{bud}"] = sp["select"]
            for name, att in sp["kernels"].items():
                methods[f"{name}_sparse_{bud}"] = (lambda a: lambda: a.run(q, **tok, out=self.out))(att)
        return methods

    def bytes(self) -> dict[str, int]:
        from hack_ops.triton import benchcases as bc

        c, s = self.case, self.case.shape
        cuda = cuda_decode_bytes(c.layout, c.seq_lens, s.q_heads)
        out = {"cuda": cuda, "cuda_fragment": cuda, "cuda_stages3": cuda, "triton": bc.hack_decode_bytes(c.layout, c.seq_lens, s.q_heads),
               "bf16": bc.bf16_decode_bytes(c.seq_lens, s.kv_heads, s.q_heads, s.head_dim)}
        for bud, sp in self.sparse.items():
            out[f"select_{bud}"] = select_bytes(c.layout, c.seq_lens, s.q_heads)
            out[f"cuda_sparse_{bud}"] = cuda_decode_bytes(c.layout, sp["seq_lens"], s.q_heads)
            out[f"triton_sparse_{bud}"] = bc.hack_decode_bytes(c.layout, sp["seq_lens"], s.q_heads)
        return out

    def differences(self) -> dict[str, float]:
        """Max |difference| of the CUDA kernel's output from the Triton kernel's (INT8 Q'/P', same
        pages) and from BF16 attention (the 2-bit error itself): sanity numbers beside the timings."""
        m = self.methods()
        cuda = m["cuda"]().float().clone()
        frag = m["cuda_fragment"]().float()
        out = {"cuda_vs_fragment": float((cuda - frag).abs().max()),
               "cuda_vs_stages3": float((cuda - m["cuda_stages3"]().float()).abs().max()),
               "cuda_vs_triton": float((cuda - m["triton"]().float()).abs().max()),
               "cuda_vs_bf16": float((cuda - m["bf16"]().float()).abs().max())}
        for bud in self.sparse:  # the same pages through both kernels; and what the budget drops
            sp = m[f"cuda_sparse_{bud}"]().float().clone()
            out[f"cuda_sparse_{bud}_vs_triton_sparse"] = float((sp - m[f"triton_sparse_{bud}"]().float()).abs().max())
            out[f"cuda_sparse_{bud}_vs_cuda"] = float((sp - cuda).abs().max())
        return out

    def release(self) -> None:
        self.case.release()
        self.frag_bufs = self.cuda = None


def row_from(cell: Cell, times: dict[str, float], nbytes: dict[str, int], copy_bps: float, splits) -> dict:
    methods = {}
    for m, ms in times.items():
        bps = nbytes[m] / (ms * 1e-3)
        methods[m] = {"median_ms": round(ms, 4), "bytes": nbytes[m], "gb_per_s": round(bps / 1e9, 1),
                      "fraction_of_copy": round(bps / copy_bps, 3)}
    speedup = times["bf16"] / times["cuda"]
    row = {**asdict(cell), "splits": list(splits), "methods": methods, "cuda_vs_bf16": round(speedup, 2),
           "fragment_vs_bf16": round(times["bf16"] / times["cuda_fragment"], 2),
           **({"stages3_vs_cuda": round(times["cuda"] / times["cuda_stages3"], 2)} if "cuda_stages3" in times else {}),
           "cuda_vs_triton": round(times["triton"] / times["cuda"], 2),
           "targets": targets(cell, speedup, methods["cuda"]["fraction_of_copy"])}
    budgets = sorted(int(m.rsplit("_", 1)[1]) for m in times if m.startswith("select_"))
    if budgets:
        row["sparse"] = {str(b): sparse_row(cell, times, b) for b in budgets}
    return row


def sparse_row(cell: Cell, times: dict[str, float], budget: int) -> dict:
    """One budget's sparse step (the device selection, then the CUDA kernel over its tables)
    against dense CUDA decode and BF16, with the sparse issue's decode targets where they apply
    (x5 dense at 32K and a 2K budget, the selection <= 15% of the step)."""
    step = times[f"select_{budget}"] + times[f"cuda_sparse_{budget}"]
    share = times[f"select_{budget}"] / step
    vs_dense = times["cuda"] / step
    at = cell.context >= 32768 and budget == 2048
    return {"step_ms": round(step, 4), "vs_cuda": round(vs_dense, 2), "vs_bf16": round(times["bf16"] / step, 2),
            "selection_share": round(share, 3), "triton_sparse_ms": round(times[f"triton_sparse_{budget}"], 4),
            "targets": {"ge_5x_dense_32k_2k": vs_dense >= 5.0 if at else None,
                        "selection_le_15pct": share <= 0.15 if at else None}}


def table(doc: dict) -> str:
    lines = gpu_run_header(doc, f"torch {doc['torch']}, triton {doc['triton']}, nvcc {doc.get('nvcc', '?')}")
    s3 = any("cuda_stages3" in r["methods"] for r in doc["results"])  # runs before the 3-page ring had none
    lines += ["| shape | batch | context | CUDA ms | fragment ms | " + ("3 stages ms | " if s3 else "") +
              "Triton ms | BF16 ms | CUDA vs BF16 | fragment vs BF16 | CUDA GB/s (of copy) | BF16 GB/s (of copy) | targets |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if s3 else "")]
    for r in doc["results"]:
        m = r["methods"]
        t = [k for k, v in r["targets"].items() if v is False]
        ring = f"| {m['cuda_stages3']['median_ms']:.3f} " if s3 and "cuda_stages3" in m else ("| ? " if s3 else "")
        lines.append(f"| {r['shape']} | {r['batch']} | {r['context']} | {m['cuda']['median_ms']:.3f} "
                     f"| {m['cuda_fragment']['median_ms']:.3f} {ring}| {m['triton']['median_ms']:.3f} "
                     f"| {m['bf16']['median_ms']:.3f} | x{r['cuda_vs_bf16']:.2f} | x{r['fragment_vs_bf16']:.2f} "
                     f"| {m['cuda']['gb_per_s']:.0f} ({100 * m['cuda']['fraction_of_copy']:.0f}%) "
                     f"| {m['bf16']['gb_per_s']:.0f} ({100 * m['bf16']['fraction_of_copy']:.0f}%) "
                     f"| {'met' if not t else 'missed: ' + ', '.join(t)} |")
    for s in doc.get("skipped", []):
        lines.append(f"| {s['shape']} | {s['batch']} | {s['context']} | skipped: {s['reason']} | | | | | | | | |")
    sparse = [r for r in doc["results"] if r.get("sparse")]
    if sparse:
        lines += ["", "Sparse decode (`--sparse-budgets`): the device selection (hack_ops.triton.sparse, torch) "
                  "then the CUDA kernel over its per-head page tables, against dense CUDA decode of the same pages "
                  "and BF16:", "",
                  "| shape | batch | context | budget | select ms | CUDA sparse ms | step ms | vs dense CUDA | vs BF16 "
                  "| selection share | Triton sparse ms | targets |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sparse:
            m = r["methods"]
            for bud, sp in r["sparse"].items():
                t = [k for k, v in sp["targets"].items() if v is False]
                met = "n/a" if all(v is None for v in sp["targets"].values()) else ("met" if not t else "missed: "
                                                                                    + ", ".join(t))
                lines.append(f"| {r['shape']} | {r['batch']} | {r['context']} | {bud} "
                             f"| {m[f'select_{bud}']['median_ms']:.3f} | {m[f'cuda_sparse_{bud}']['median_ms']:.3f} "
                             f"| {sp['step_ms']:.3f} | x{sp['vs_cuda']:.2f} | x{sp['vs_bf16']:.2f} "
                             f"| {100 * sp['selection_share']:.0f}% | {sp['triton_sparse_ms']:.3f} | {met} |")
    return "\n".join(lines)


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) <= 0:
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return vals


def plan_cells(shapes: list[str], batches, contexts, free_bytes: int) -> tuple[list[Cell], list[dict]]:
    cells, skipped = [], []
    for name in shapes:
        _, h, d = SHAPES[name]
        for batch in batches:
            for ctx in contexts:
                if ctx % 64:
                    raise ValueError(f"contexts must be whole 64-token pages, got {ctx}")
                need = MEMORY_FACTOR * 2 * batch * ctx * h * d * 2
                if need > free_bytes:
                    skipped.append({"shape": name, "batch": batch, "context": ctx,
                                    "reason": f"needs ~{need / 2**30:.0f} GiB, {free_bytes / 2**30:.0f} GiB free"})
                else:
                    cells.append(Cell(name, batch, ctx))
    return cells, skipped


@contextlib.contextmanager
def _cell(cell: Cell, baseline, device: torch.device, budgets: tuple[int, ...] = ()):
    """One cell's data for the block's length, its memory freed after (also after a failure)."""
    c = CudaCell(cell, baseline, device, budgets)
    try:
        yield c
    finally:
        c.release()
        del c
        try:
            torch.cuda.empty_cache()
        except RuntimeError:
            pass  # a lost context: the caller stops the grid


def measure_cell(cell: Cell, baseline, device: torch.device, repeats: int, flush, copy_bps: float,
                 budgets: tuple[int, ...] = ()) -> dict:
    """One cell's timings, bytes, targets and output differences (and sparse rows per budget)."""
    from hack_ops.triton import benchcases as bc

    with _cell(cell, baseline, device, budgets) as c:
        times = bc.median_ms(c.methods(), repeats, WARMUP, bc.Timer(device), flush)
        row = row_from(cell, times, c.bytes(), copy_bps, c.splits)
        row["max_abs_diff"] = {k: round(v, 5) for k, v in c.differences().items()}
        return row


def sweep_cell(cell: Cell, baseline, device: torch.device, repeats: int, flush, counts: tuple[int, ...]) -> dict:
    """The CUDA kernel's time at each split count of `counts` (and at the one choose_splits
    picks) beside BF16's, on one cell: the data the split rule is checked against."""
    from hack_ops.cuda import CodeOrder, CudaDecodeAttention
    from hack_ops.cuda.decode import MAX_SPLITS
    from hack_ops.triton import benchcases as bc
    from hack_ops.triton.store import cache_kwargs

    with _cell(cell, baseline, device) as c:
        b, q, kw = c.case.hack.batch, c.case.q, cache_kwargs(c.case.bufs)
        methods = {"bf16": c.case.run_bf16}
        for n in sorted({n for n in counts if n <= MAX_SPLITS}):
            att = CudaDecodeAttention(c.case.layout, c.case.shape.q_heads, num_splits=n, order=CodeOrder.TOKEN)
            att.plan(b.kv_indptr, b.kv_indices, b.seq_lens, b.tail_rows, b.sink_slots)
            methods[f"splits_{n}"] = (lambda a: lambda: a.run(q, **kw, out=c.out))(att)
        methods["auto"] = c.methods()["cuda"]
        times = bc.median_ms(methods, repeats, WARMUP, bc.Timer(device), flush)
        return {**asdict(cell), "auto_splits": list(c.splits), "ms": {k: round(v, 4) for k, v in times.items()}}


def _context_lost(device: torch.device) -> bool:
    """True when the CUDA context no longer runs work (a sticky error such as an illegal address)."""
    try:
        torch.ones(1, device=device).add_(1).item()
        return False
    except RuntimeError:
        return True


def nvcc_version() -> str:
    import subprocess

    from hack_ops.cuda.build import nvcc

    tool = nvcc()
    if tool is None:
        return "none"
    out = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    return out[-1] if out else "?"


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("bench_decode_cuda needs a CUDA GPU, and torch sees none here", file=sys.stderr)
        return 2
    import triton

    from hack_ops.triton import benchcases as bc

    device = torch.device("cuda")
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        raise ValueError(f"unknown shapes {bad}; choose from {list(SHAPES)}")
    budgets = _ints(args.sparse_budgets, "--sparse-budgets") if args.sparse_budgets else ()
    baseline = bc.choose_baseline(device, bc.flashinfer_importable())
    free, _ = torch.cuda.mem_get_info(device)
    cells, skipped = plan_cells(shapes, _ints(args.batches, "--batches"), _ints(args.contexts, "--contexts"),
                                int(0.9 * free))
    flush = bc.l2_flush(device)
    copy_bps = bc.copy_bandwidth(device)
    head = {"device": torch.cuda.get_device_name(device), "capability": list(torch.cuda.get_device_capability(device)),
            "date": datetime.date.today().isoformat(), "command": args.command_line, "bf16_baseline": baseline.value,
            "torch": torch.__version__, "triton": triton.__version__, "nvcc": nvcc_version(),
            "repeats": args.repeats, "warmup": WARMUP, "copy_bandwidth_gb_per_s": round(copy_bps / 1e9, 1)}
    print(f"decode on {head['device']}: copy {copy_bps / 1e9:.0f} GB/s; BF16 baseline: {baseline.value}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []

    def save(done: int) -> None:
        out.write_text(json.dumps({**head, "complete": False, "cells_done": done, "cells_planned": len(cells),
                                   "results": results, "skipped": skipped}, indent=1) + "\n")

    if args.sweep_splits:
        counts = _ints(args.sweep_splits, "--sweep-splits")
        head["sweep"] = []
        for cell in cells:
            head["sweep"].append(sweep_cell(cell, baseline, device, args.repeats, flush, counts))
            out.write_text(json.dumps(head, indent=1) + "\n")
            r = head["sweep"][-1]
            best = min((v, k) for k, v in r["ms"].items() if k.startswith("splits_"))
            print(f"{cell}: auto {r['auto_splits']} {r['ms']['auto']:.4f} ms, best {best[1]} {best[0]:.4f} ms, "
                  f"bf16 {r['ms']['bf16']:.4f} ms", flush=True)
        return 0
    for i, cell in enumerate(cells):
        try:
            row = measure_cell(cell, baseline, device, args.repeats, flush, copy_bps, budgets=budgets)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            # One cell's failure is a result too; the rest of the grid still runs unless the
            # CUDA context is gone (an illegal address is sticky: every later call fails alike).
            skipped.append({**asdict(cell), "reason": f"failed: {str(exc).splitlines()[0][:300]}"})
            print(f"{cell}: failed: {exc}", file=sys.stderr, flush=True)
            save(i + 1)
            if _context_lost(device):
                return 1
            continue
        results.append(row)
        save(i + 1)
        m = row["methods"]
        print(f"{cell.shape:10s} batch {cell.batch:3d} context {cell.context:6d}: "
              + "  ".join(f"{k} {v['median_ms']:.3f} ms ({v['gb_per_s']:.0f} GB/s)" for k, v in m.items())
              + f"  cuda vs bf16 x{row['cuda_vs_bf16']:.2f}", flush=True)
    out.write_text(json.dumps({**head, "complete": True, "results": results, "skipped": skipped}, indent=1) + "\n")
    return 0


def render_json(path: Path) -> int:
    """docs/kernels.md's CUDA decode table from a GPU run's JSON (no GPU needed)."""
    return render_gpu_run(path, "bench_decode_cuda", "decode-cuda", DOC_BLOCK, table,
                          "### CUDA decode kernel: measured on a GPU")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hack_cli.bench_decode_cuda", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--out", default="decode-cuda.json", help="the JSON, rewritten after every cell")
    ap.add_argument("--sweep-splits", default="",
                    help="comma-separated split counts: time the CUDA kernel at each (and at its own choice) "
                         "per cell instead of the method grid, to check the split rule")
    ap.add_argument("--sparse-budgets", default="",
                    help="comma-separated token budgets: per cell also sparse decode at each (the device selection, "
                         "then the CUDA and Triton kernels over its per-head page tables; --hack-sparse-budget)")
    ap.add_argument("--from-json", type=Path, help="render a GPU run's JSON into docs/kernels.md (no GPU)")
    return gpu_bench_cli(ap, argv, run, render_json)


if __name__ == "__main__":
    sys.exit(main())
