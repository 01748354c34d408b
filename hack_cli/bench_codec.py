"""`hack bench codec`: SplitZip on real KV of a prepared model, one core.

Per layer, K and V: coded size / raw size with the model's codebook (calibrated if the model
folder has kv_codebook.json, else the default). Throughput of the compiled codec on one
thread (native AVX-512 and portable C) over all layers' KV in one buffer, best of N runs with
the output buffers touched beforehand; the NumPy reference as the baseline of the same run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from .bench_timing import best_of
from .bench_doc import DOCS, command_line, replace_block

DOC = DOCS / "kernels.md"


def register(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("codec", help="SplitZip ratio per layer (K, V) and encode/decode GB/s on one core")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--repeat", type=int, default=8, help="each calibration prompt repeated N times")
    p.add_argument("--runs", type=int, default=5, help="timing runs (best is reported)")
    p.add_argument("--out", default="docs/bench/codec.json", help="write the JSON result here")
    p.add_argument("--no-doc", action="store_true", help="do not update docs/kernels.md")
    p.set_defaults(func=run_cli)


def run_default(args: argparse.Namespace) -> int:
    return run_cli(argparse.Namespace(model="smollm2", repeat=8, runs=5, out="docs/bench/codec.json",
                                      no_doc=False))




def measure(model: str, repeat: int, runs: int) -> dict:
    from hack_eval.models import prepare
    from hack_ops.codec import codebook as cb
    from hack_ops.codec import cpu, reference
    from hack_ops.codec.format import FloatFormat, max_stream_bytes

    from .codec_kv import collect

    folder = prepare(model, log=lambda m: print(m, file=sys.stderr))
    books = cb.for_model(folder)
    kv = collect(folder, repeat=repeat)
    res: dict = {"model": model, "codebooks": books.source, "tokens": int(kv[0][0].shape[0]),
                 "layers": [], "throughput": []}
    for fmt in FloatFormat:
        book = books.get(fmt)
        rows = []
        for i, (k, v) in enumerate(kv):
            k, v = k.to(fmt.torch_dtype), v.to(fmt.torch_dtype)
            rows.append({"layer": i, "k": cpu.encode(k, book).numel() / k.nbytes,
                         "v": cpu.encode(v, book).numel() / v.nbytes})
        res["layers"].append({"format": fmt.name.lower(), "exponents": list(book.exponents), "rows": rows})
        x = torch.cat([t.reshape(-1) for pair in kv for t in pair]).to(fmt.torch_dtype)
        n = x.numel()
        cap = max_stream_bytes(n)
        buf = torch.zeros(cap, dtype=torch.uint8)
        y = torch.zeros_like(x)
        for variant in ("native", "portable"):
            size = cpu.encode_ptr(x.data_ptr(), n, book, buf.data_ptr(), cap, variant=variant)
            te = best_of(lambda: cpu.encode_ptr(x.data_ptr(), n, book, buf.data_ptr(), cap, variant=variant), runs)
            td = best_of(lambda: cpu.decode_ptr(buf.data_ptr(), size, book, y.data_ptr(), n, variant=variant), runs)
            if not torch.equal(x.view(torch.int16), y.view(torch.int16)):
                raise RuntimeError(f"{variant} codec did not round-trip the {fmt.name} KV bitwise")
            res["throughput"].append({"format": fmt.name.lower(), "impl": f"C {variant}", "bytes": 2 * n,
                                      "ratio": size / (2 * n), "encode_gbs": 2 * n / te / 1e9,
                                      "decode_gbs": 2 * n / td / 1e9})
        small = x[: 1 << 20]
        stream = reference.encode(small, book)
        te = best_of(lambda: reference.encode(small, book), 1)
        td = best_of(lambda: reference.decode(stream, book), 1)
        res["throughput"].append({"format": fmt.name.lower(), "impl": "NumPy reference", "bytes": 2 * small.numel(),
                                  "ratio": len(stream) / (2 * small.numel()),
                                  "encode_gbs": 2 * small.numel() / te / 1e9, "decode_gbs": 2 * small.numel() / td / 1e9})
    res["simd"] = bool(cpu.load("native").sz_simd())
    return res


def render(res: dict, command: str) -> str:
    lines = [f"Command: `{command}`  ", f"Measured: {res['date']} on this project's CPU host, one thread "
             "(2 cores shared with other work; throughput is the best of the runs).", "",
             f"Real KV of {res['model']} (transformers, BF16 weights, {res['tokens']} tokens of 4 prompts), "
             f"codebook: {res['codebooks']}.", "",
             "| format | impl | KV bytes | coded/raw | encode GB/s | decode GB/s |", "|---|---|---|---|---|---|"]
    for t in res["throughput"]:
        lines.append(f"| {t['format']} | {t['impl']} | {t['bytes'] / 1e6:.1f} MB | {100 * t['ratio']:.2f}% "
                     f"| {t['encode_gbs']:.2f} | {t['decode_gbs']:.2f} |")
    for lay in res["layers"]:
        ks = [r["k"] for r in lay["rows"]]
        vs = [r["v"] for r in lay["rows"]]
        lines += ["", f"{lay['format'].upper()} coded/raw per layer (exponents {lay['exponents']}): "
                  f"K mean {100 * statistics.fmean(ks):.2f}% (max {100 * max(ks):.2f}%), "
                  f"V mean {100 * statistics.fmean(vs):.2f}% (max {100 * max(vs):.2f}%)", "",
                  "| layer | " + " | ".join(str(r["layer"]) for r in lay["rows"]) + " |",
                  "|---|" + "---|" * len(lay["rows"]),
                  "| K | " + " | ".join(f"{100 * r['k']:.1f}" for r in lay["rows"]) + " |",
                  "| V | " + " | ".join(f"{100 * r['v']:.1f}" for r in lay["rows"]) + " |"]
    bf = [t for t in res["throughput"] if t["format"] == "bf16" and t["impl"] == "C native"]
    if bf:
        t = bf[0]
        lines += ["", f"- BF16 KV coded to {100 * t['ratio']:.2f}% of raw (target <= 78%: "
                  f"{'met' if t['ratio'] <= 0.78 else 'missed'}); encode {t['encode_gbs']:.2f} GB/s (target >= 1: "
                  f"{'met' if t['encode_gbs'] >= 1 else 'missed'}), decode {t['decode_gbs']:.2f} GB/s (target >= 2: "
                  f"{'met' if t['decode_gbs'] >= 2 else 'missed'}) on one core"]
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    if args.repeat < 1 or args.runs < 1:
        raise ValueError("--repeat and --runs must be >= 1")
    res = measure(args.model, args.repeat, args.runs)
    res["date"] = time.strftime("%Y-%m-%d")
    command = command_line("codec")
    res["command"] = command
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    text = render(res, command)
    if not args.no_doc:
        replace_block(DOC, "codec", text, heading="## Lossless transfer codec (SplitZip)")
    print(text)
    return 0
