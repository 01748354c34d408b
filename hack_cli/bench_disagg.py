"""`hack bench disagg`: BF16 (raw, lossless-coded, FP8) vs dequant vs HACK disaggregated serving across link rates."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .bench_doc import DOCS, command_line, replace_block
from .cmd_cluster import MODEL_HELP

DOC = DOCS / "disagg.md"


def register(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("disagg", help="JCT/TTFT and breakdown of KV methods (bf16, bf16-lossless, fp8, dequant, hack, ...) over shaped links")
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    p.add_argument("--methods", default="bf16,dequant,hack",
                   help="comma-separated KV methods of `hack up --kv` (e.g. bf16,bf16-lossless,fp8,dequant,hack)")
    p.add_argument("--rates", default="100,1000,10000", help="link rates in Mbit/s, comma-separated")
    p.add_argument("--workload", default="longdoc", help="a workload of datasets/workloads.json")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--rps", type=float, default=0.05, help="Poisson arrival rate (requests/s)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="override the workload's prompt length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.add_argument("--out", default=None, help="also write the JSON result here")
    p.add_argument("--no-doc", action="store_true", help="do not update docs/disagg.md")
    p.add_argument("--doc-block", default="disagg",
                   help="the docs/disagg.md marker block to write (keeps earlier runs' tables)")
    p.add_argument("--plot", default=None,
                   help="also draw mean JCT against link rate per method into this PNG (a link sweep)")
    p.set_defaults(func=run_cli)


def run_default(args: argparse.Namespace) -> int:
    ns = argparse.Namespace(model="smollm2", methods="bf16,dequant,hack", rates="100,1000,10000",
                            workload="longdoc", requests=4, rps=0.05, prompt_tokens=None, seed=0,
                            json=False, out=None, no_doc=False, doc_block="disagg", plot=None)
    return run_cli(ns)


def _fmt(v, unit: str = "s") -> str:
    return "n/a" if v is None else f"{v:.2f}{unit}" if unit else f"{v:.2f}"


def render(result: dict, command: str) -> str:
    from disagg.bench import compare

    lines = [f"Command: `{command}`  ", f"Measured: {result['date']} on this project's "
             "CPU host (2 shared cores; absolute times are noisy, compare within a row group).", "",
             f"Workload `{result['workload']}`: {result['requests']} requests, Poisson "
             f"{result['rps']} req/s, seed {result['seed']}.", "",
             "| method | link Mbit/s | ok | mean JCT | p50 JCT | p99 JCT | mean TTFT | p50 TTFT | p99 TTFT "
             "| prefill | quantization | transfer (exposed) | approx./dequant. | decode | waiting "
             "| on the wire | KV bytes/request |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in sorted(result["points"], key=lambda p: (p["link_mbps"], p["method"])):
        b = p["breakdown_s"]
        parts = [b[k] for k in ("approximation", "dequantization") if b.get(k) is not None]
        approx = sum(parts) if parts else None  # a method has one of them, the other is 0
        wire = p.get("wire_bytes_mean")
        lines.append(
            f"| {p['method']} | {p['link_mbps']:g} | {p['ok']}/{p['requests']} | {_fmt(p['jct_s']['mean'])} "
            f"| {_fmt(p['jct_s']['p50'])} | {_fmt(p['jct_s']['p99'])} | {_fmt(p['ttft_s']['mean'])} "
            f"| {_fmt(p['ttft_s']['p50'])} | {_fmt(p['ttft_s']['p99'])} | {_fmt(b.get('prefill'))} "
            f"| {_fmt(b.get('quantization'))} | {_fmt(b.get('transfer'))} | {_fmt(approx)} "
            f"| {_fmt(b.get('decode'))} | {_fmt(b.get('waiting'))} | {_fmt(p.get('wire_s_mean'))} "
            f"| {'n/a' if wire is None else f'{wire / 1e6:.1f} MB'} |")
    from .bench_plot import summary_lines

    sweep = summary_lines(result) if len(result["rates_mbps"]) > 2 else []
    lines += ["", *[f"- {c}" for c in compare(result) + sweep]]
    return "\n".join(lines)


def write_doc(block: str, name: str = "disagg") -> None:
    replace_block(DOC, name, block)


def run_cli(args: argparse.Namespace) -> int:
    from disagg.bench import run, save_json

    from .cmd_cluster import _model_path

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if not methods or not rates:
        raise ValueError("--methods and --rates must name at least one value each")
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    result = run(_model_path(args.model), methods, rates, args.workload, args.requests, args.rps,
                 seed=args.seed, prompt_tokens=args.prompt_tokens, log=log)
    result["date"] = time.strftime("%Y-%m-%d")
    command = command_line("disagg")
    result["command"] = command
    if args.out:
        save_json(result, Path(args.out))
    if getattr(args, "plot", None):
        from .bench_plot import plot

        plot(result, Path(args.plot))
    if not args.no_doc:
        write_doc(render(result, command), getattr(args, "doc_block", "disagg"))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(render(result, command))
    return 0
