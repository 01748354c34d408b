"""`hack bench rotation`: what `--hack-rotation` costs per layer on one CPU thread.

The backend rotates a layer's q/k/v once before the store and attention and the output back
once after (hack_ops.rotation). Timed here, best of N on the CPU clock: that rotation for the
K+V scope (4 products: q, k, v, output) and the V scope (2: v, output), as the D x D product the
backend uses and as the butterfly FWHT; the baseline of the same run is the HACK attention
of the same layer shape (extend of a prompt, or a decode step at a context), store included.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .bench_timing import best_of

# (name, q heads, kv heads, head_dim): SmolLM2-135M and Gemma-3-270M
SHAPES = [("smollm2", 9, 3, 64), ("gemma3", 4, 1, 256)]


def register(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("rotation", help="cost of --hack-rotation per layer vs the HACK attention (one thread)")
    p.add_argument("--prefill", type=int, default=2048, help="prompt tokens of the extend case (default 2048)")
    p.add_argument("--batch", type=int, default=8, help="decode batch (default 8)")
    p.add_argument("--context", type=int, default=2048, help="decode context per request (default 2048)")
    p.add_argument("--runs", type=int, default=7, help="timing runs (best is reported)")
    p.add_argument("--out", default="docs/bench/rotation.json", help="write the JSON result here ('' = none)")
    p.set_defaults(func=run_cli)


def run_default(args: argparse.Namespace) -> int:
    return run_cli(argparse.Namespace(prefill=2048, batch=8, context=2048, runs=7, out="docs/bench/rotation.json"))




def _rotation_calls(q, k, v, how: str, scope: str):
    """One layer's rotation work: q, k, v in, and the output (shaped like q) back."""
    from hack_ops.rotation import Rotation, fwht, restore_output, rotate_qkv

    rot = Rotation.HADAMARD_KV if scope == "kv" else Rotation.HADAMARD_V
    o = q.clone()  # stands for the attention output [tokens, q heads, D]
    if how == "matmul":
        return lambda: (rotate_qkv(q, k, v, rot), restore_output(o, rot))

    def butterfly():
        if scope == "kv":
            fwht(q).to(q.dtype), fwht(k).to(k.dtype)
        fwht(v).to(v.dtype), fwht(o).to(o.dtype)  # Hᵀ = H: the way back is the same transform

    return butterfly


def measure(prefill: int, batch: int, context: int, runs: int) -> dict:
    from hack_ops.paged.benchcases import DecodeCase, PrefillCase

    torch.set_num_threads(1)
    rows = []
    for name, hq, h, d in SHAPES:
        g = torch.Generator().manual_seed(0)
        for phase, tokens in (("prefill", prefill), ("decode", batch)):
            if phase == "prefill":
                case = PrefillCase(hq, h, d, prefill)
                attn = case.methods()["hack"]
            else:
                case = DecodeCase(hq, h, d, batch, context)
                attn = case.methods()["hack"]
            base = best_of(attn, runs, warmup=True)
            case.release()
            q = torch.randn(tokens, hq, d, generator=g).to(torch.bfloat16)
            k = torch.randn(tokens, h, d, generator=g).to(torch.bfloat16)
            v = torch.randn(tokens, h, d, generator=g).to(torch.bfloat16)
            for scope in ("kv", "v"):
                for how in ("matmul", "fwht"):
                    s = best_of(_rotation_calls(q, k, v, how, scope), runs, warmup=True)
                    rows.append({"model_shape": name, "q_heads": hq, "kv_heads": h, "head_dim": d,
                                 "phase": phase, "tokens": tokens, "context": context if phase == "decode" else prefill,
                                 "scope": scope, "method": how, "rotation_s": s, "hack_attention_s": base,
                                 "ratio": s / base})
    return {"threads": 1, "runs": runs, "rows": rows}


def render(res: dict) -> str:
    lines = ["| shape | phase | tokens | scope | method | rotation | HACK attention | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['model_shape']} (Hq {r['q_heads']}, H {r['kv_heads']}, D {r['head_dim']}) | {r['phase']} "
                     f"| {r['tokens']} | {r['scope']} | {r['method']} | {r['rotation_s'] * 1e3:.3f} ms "
                     f"| {r['hack_attention_s'] * 1e3:.2f} ms | {r['ratio'] * 100:.2f}% |")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    for name in ("prefill", "batch", "context", "runs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    res = measure(args.prefill, args.batch, args.context, args.runs)
    print(render(res))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0
