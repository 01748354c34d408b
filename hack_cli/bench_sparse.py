"""`hack bench sparse`: sparse decode against dense HACK decode on this CPU, one layer.

Per cell (shape x batch x context), measured side by side in one run on the same store:
  dense        HACK decode over every page (the compiled kernel)
  sparse-B     HACK decode over the pages hack_ops.sparse selects with a budget of B tokens per
               (request, KV head), the selection included (--hack-sparse-budget B; with
               --refine R, the selection refined: --hack-sparse-refine R)
  select-B     the selection alone (page scores from the side tables, top-k, page table), as a
               layer of a server's step makes it: one call through the step's prepared arguments
               and outputs; one level scores from the side tables' copies a server keeps
               (hack_ops.paged.side_copies)
  select-B-first  the same at a step's first sparse layer, which prepares them (once a step;
               one level)
  select-B-in-pages  the same selection reading the side tables inside the scattered pages
  bf16         torch SDPA over a contiguous BF16 cache of the same context (for scale)
Reported: medians, sparse speedup over dense, and the selection's share of the sparse step. Each
timed call starts from cold caches by default (--cache cold), as a layer of a served step does.
The store step that writes the new token is not timed (for no method). Writes
docs/bench/sparse.json (or --out) with the host: the CPU model and whether it has AMX.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from .bench_attention_options import SHAPES

DEFAULT_OUT = Path("docs/bench/sparse.json")


def register(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("sparse", help="sparse decode (--hack-sparse-budget) vs dense HACK decode, one layer")
    p.add_argument("--shapes", default="smollm2,llama3-8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--batches", default="1,4", help="comma-separated batch sizes (default 1,4)")
    p.add_argument("--contexts", default="8192,32768", help="comma-separated context lengths (default 8192,32768)")
    p.add_argument("--budgets", default="1024,2048", help="comma-separated token budgets (default 1024,2048)")
    p.add_argument("--score", choices=("bound", "linear"), default="bound", help="page score (default bound)")
    p.add_argument("--groups", type=int, default=0, help="two-level selection over groups of this many pages")
    p.add_argument("--refine", type=int, default=1,
                   help="candidates per free page ranked by their own keys (--hack-sparse-refine; default 1: off)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per cell (default 7)")
    p.add_argument("--threads", type=int, default=None, help="torch/kernel threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time; cpu: this process's CPU time (with --threads 1, immune to other "
                        "processes on a shared machine)")
    p.add_argument("--cache", choices=("cold", "warm"), default="cold",
                   help="cold (default): every timed call starts after a 64 MB write, as a served step's layer "
                        "starts after the other layers and the weights went through the caches; warm: back to back "
                        "(the method after the BF16 baseline then starts cold, the others warm)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"JSON result (default {DEFAULT_OUT}; '' for none)")
    p.set_defaults(func=run)


def run_default(args: argparse.Namespace) -> int:
    return run(argparse.Namespace(shapes="smollm2,llama3-8b", batches="1,4", contexts="8192,32768",
                                  budgets="1024,2048", score="bound", groups=0, refine=1, repeats=7, threads=None,
                                  clock="wall", cache="cold", out=str(DEFAULT_OUT)))


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) <= 0:
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return vals


def host() -> dict:
    """The CPU these numbers come from (model name, cores, AMX or not)."""
    from hack_ops.paged.cpu_extend import cpu_has_amx_int8

    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": name, "cores": os.cpu_count(), "amx": cpu_has_amx_int8(), "threads": torch.get_num_threads()}


FLUSH_BYTES = 64 << 20  # past the last-level cache of this project's hosts (32 MB a CCX on the EPYC)


def cache_flusher() -> Callable[[], object]:
    """A call that writes FLUSH_BYTES, leaving every cache level holding that buffer, not a method's data."""
    buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8)
    turn = [0]

    def flush() -> object:
        turn[0] ^= 1
        return buf.fill_(turn[0])

    return flush


def _medians(fns: dict, repeats: int, clock=time.perf_counter, flush: Callable[[], object] | None = None
             ) -> dict[str, float]:
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {m: [] for m in fns}
    for _ in range(repeats):  # methods take turns: a load change on a shared host hits them alike
        for m, fn in fns.items():
            if flush is not None:  # outside the timing: every call starts from the same cold caches
                flush()
            t0 = clock()
            fn()
            times[m].append((clock() - t0) * 1e3)
    return {m: round(statistics.median(t), 4) for m, t in times.items()}


def measure(shape: str, batch: int, context: int, budgets: list[int], score: str, groups: int,
            repeats: int, clock=time.perf_counter, refine: int = 1, flush: Callable[[], object] | None = None
            ) -> dict:
    """One cell: medians (ms) per method, speedups over dense and selection shares."""
    import torch.nn.functional as F

    from hack_ops.paged import decode
    from hack_ops.paged.benchcases import DecodeCase
    from hack_ops.paged.group_boxes import GroupBoxCache
    from hack_ops.paged.side_copies import SideTableCopies
    from hack_ops.paged.sparse import SparseDecode, forget_prepared, select_for_decode
    from hack_ops.sparse import SparseConfig

    hq, h, d = SHAPES[shape]
    case = DecodeCase(hq, h, d, batch, context)
    q4 = case.q.reshape(batch, hq, 1, d)
    fns = {"dense": lambda: decode(case.store, 0, case.plan, case.q),
           "bf16": lambda: F.scaled_dot_product_attention(q4, case.k16, case.v16, enable_gqa=hq != h)}
    read = {}
    for b in budgets:
        cfg = SparseConfig(budget_tokens=b, dense_layers=0, score=score, group_pages=groups, refine=refine)
        # two levels read the boxes a server keeps across steps (computed by the probe below)
        boxes = GroupBoxCache(groups) if groups else None
        # one level reads the side tables' copies a server keeps across steps (made by the probe)
        copies = None if groups else SideTableCopies()
        fns[f"sparse-{b}"] = lambda cfg=cfg, boxes=boxes, copies=copies: decode(
            case.store, 0, case.plan, case.q, sparse=SparseDecode(cfg, boxes=boxes, copies=copies))
        # the selection as a server's step makes it (reuse: prepared at the step's first sparse
        # layer, then one call a layer), and that first layer's preparation with it
        fns[f"select-{b}"] = lambda cfg=cfg, boxes=boxes, copies=copies: select_for_decode(
            case.store, 0, case.plan, case.q, cfg, boxes, copies, reuse=True)
        if copies is not None:  # (one level: two levels are not prepared per step)
            fns[f"select-{b}-first"] = lambda cfg=cfg, copies=copies: (
                forget_prepared(case.plan), select_for_decode(case.store, 0, case.plan, case.q, cfg, None, copies,
                                                              reuse=True))
            # the same selection from the side tables inside the scattered pages
            fns[f"select-{b}-in-pages"] = lambda cfg=cfg: select_for_decode(case.store, 0, case.plan, case.q, cfg,
                                                                            reuse=True)
        probe = SparseDecode(cfg, boxes=boxes, copies=copies)
        decode(case.store, 0, case.plan, case.q, sparse=probe)
        read[b] = round(probe.pages_read / max(1, probe.pages_resident), 4)
    ms = _medians(fns, repeats, clock, flush)
    case.release()
    return {"shape": shape, "batch": batch, "context": context, "ms": ms,
            "speedup": {b: round(ms["dense"] / ms[f"sparse-{b}"], 2) for b in budgets},
            "selection_share": {b: round(ms[f"select-{b}"] / ms[f"sparse-{b}"], 3) for b in budgets},
            # the share had the selection read the side tables inside the pages (one level)
            "selection_share_in_pages": {b: round(ms[f"select-{b}-in-pages"] / ms[f"sparse-{b}"], 3)
                                         for b in budgets if f"select-{b}-in-pages" in ms},
            "pages_read_fraction": read}


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise ValueError(f"--shapes takes {', '.join(SHAPES)}, got {', '.join(unknown)}")
    if args.repeats < 1:
        raise ValueError("--repeats must be positive")
    if args.groups < 0:
        raise ValueError("--groups must be non-negative")
    if args.refine < 1:
        raise ValueError("--refine must be positive")
    batches, contexts = _ints(args.batches, "--batches"), _ints(args.contexts, "--contexts")
    budgets = _ints(args.budgets, "--budgets")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    cache = getattr(args, "cache", "cold")
    machine = {**host(), "clock": args.clock, "cache": cache}
    flush = cache_flusher() if cache == "cold" else None
    print(f"host: {machine['cpu']}, {machine['cores']} CPUs, AMX {'yes' if machine['amx'] else 'no'}, "
          f"{machine['threads']} threads")
    rows = []
    for shape in shapes:
        for batch in batches:
            for ctx in contexts:
                r = measure(shape, batch, ctx, budgets, args.score, args.groups, args.repeats, clock, args.refine,
                            flush)
                rows.append(r)
                cells = "  ".join(f"sparse-{b} {r['ms'][f'sparse-{b}']:.2f} ms x{r['speedup'][b]:.2f} "
                                  f"(select {100 * r['selection_share'][b]:.0f}%"
                                  + (f" [{100 * r['selection_share_in_pages'][b]:.0f}% in pages]"
                                     if b in r["selection_share_in_pages"] else "") + ", reads "
                                  f"{100 * r['pages_read_fraction'][b]:.0f}% of pages)" for b in budgets)
                print(f"{shape:9s} batch {batch:2d} context {ctx:6d}: dense {r['ms']['dense']:.2f} ms  "
                      f"bf16 {r['ms']['bf16']:.2f} ms  {cells}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = (f"hack bench sparse --shapes {args.shapes} --batches {args.batches} --contexts {args.contexts} "
               f"--budgets {args.budgets} --score {args.score} --groups {args.groups} --refine {args.refine} "
               f"--repeats {args.repeats} "
               f"--clock {args.clock} --cache {cache}" + (f" --threads {args.threads}" if args.threads else ""))
        out.write_text(json.dumps({"command": cmd, "date": datetime.date.today().isoformat(), "host": machine,
                                   "rows": rows}, indent=1) + "\n")
        print(f"wrote {out}")
    return 0
