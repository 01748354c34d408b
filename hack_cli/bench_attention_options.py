"""The options of `hack bench attention`, one parser for both devices: the CPU benchmark
(hack_cli.bench_attention) and the GPU one (hack_cli.bench_attention_gpu, also run as
`python -m hack_cli.bench_attention_gpu` on a machine without the `hack` script) build it here,
so neither imports the other to get it."""
from __future__ import annotations

import argparse
from typing import Callable

# The CPU benchmark's named shapes: (query heads, kv heads, head_dim).
SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}


def add_parser(bsub: argparse._SubParsersAction, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """Add the `attention` subcommand to `bsub`, running `func` on its parsed arguments."""
    # hack_eval stays out of the module imports: the GPU box that runs the Triton benchmark
    # has no transformers/SGLang (tests/test_triton_imports.py).
    from hack_eval.models import MODELS

    p = bsub.add_parser("attention", help="decode/prefill attention: HACK vs BF16 SDPA vs dequantize+SDPA")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true", help="contexts 2K and 8K, fewer repeats, short prefill")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: this machine's CPU path; cuda: the Triton kernels on a GPU vs FlashInfer/SDPA "
                        "(hack_cli/bench_attention_gpu.py: its own default grid, CUDA-event timing, bandwidth)")
    p.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)} "
                                                  "(cuda: llama3-8b, qwen2.5-7b)")
    p.add_argument("--model", default=None,
                   help=f"also a prepared model's attention shape ({', '.join(MODELS)}: its query heads, KV heads "
                        "and head_dim; full causal attention, sliding windows not applied), as a row named by it; "
                        "CPU only")
    p.add_argument("--batches", default=None, help="comma-separated (default 1,8; cuda: 1,8,32,128)")
    p.add_argument("--contexts", default=None, help="comma-separated token counts (default 2048,8192,32768)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per cell (default 5, quick 3)")
    p.add_argument("--prefill-tokens", default=None,
                   help="comma-separated prompt lengths (default 2048,8192,16384, quick 1024; 0: skip)")
    p.add_argument("--store-tokens", type=int, default=None,
                   help="prompt length of the store rows (default 7500, quick 2048; 0: skip them)")
    p.add_argument("--threads", type=int, default=None, help="torch/kernel threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time; cpu: this process's CPU time (with --threads 1, immune to "
                        "other processes on a shared machine)")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument("--doc", action="store_true",
                   help="also write the tables and target lines into docs/kernels.md (CPU only)")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="with --device cuda: measure nothing; copy FILE (written by a GPU run's --out) to "
                        "docs/bench/attention-cuda.json and its table into docs/kernels.md (no GPU needed)")
    p.set_defaults(func=func)
    return p
