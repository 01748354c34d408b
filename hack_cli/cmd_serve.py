"""`hack serve`: one colocated SGLang server with the HACK KV cache on the default model.

Equivalent to `python -m sglang.launch_server --model-path "$(hack model prepare smollm2)"
--kv-cache-dtype hack --device cpu ...`; options after `--` go to SGLang unchanged (they are
validated there, e.g. `-- --hack-partition-size 32 --port 30001`).
"""
from __future__ import annotations

import argparse
import os
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run an SGLang server with the HACK KV cache (or BF16 with --bf16)")
    p.add_argument("--model", default="smollm2", help="model name for `hack model prepare`")
    p.add_argument("--model-path", default=None, help="an HF folder instead of a prepared model")
    p.add_argument("--bf16", action="store_true", help="the BF16 baseline (torch_native attention) instead")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, help="-- then options for sglang.launch_server")
    p.set_defaults(func=_serve)


def command(args: argparse.Namespace, model_path: str) -> list[str]:
    extra = list(args.sglang_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    mode = ["--attention-backend", "torch_native"] if args.bf16 else ["--kv-cache-dtype", "hack"]
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--device", "cpu",
            "--host", args.host, "--port", str(args.port), *mode, *extra]


def _serve(args: argparse.Namespace) -> int:
    if args.model_path:
        model_path = args.model_path
    else:
        from hack_eval.models import prepare

        model_path = str(prepare(args.model, log=lambda m: print(m, file=sys.stderr)))
    cmd = command(args, model_path)
    print(" ".join(cmd), file=sys.stderr)
    os.execv(cmd[0], cmd)  # the server takes over this process (signals, exit status)
    return 0  # not reached
