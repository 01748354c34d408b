"""`hack serve`: one colocated SGLang server with the HACK KV cache on the default model.

Equivalent to `python -m sglang.launch_server --model-path "$(hack model prepare smollm2)"
--kv-cache-dtype hack --device cpu ...`; options after `--` go to SGLang unchanged (they are
validated there, e.g. `-- --hack-partition-size 32 --port 30001`).

Like `hack up`, it records a run: a new run directory under the runs root (or `--run-dir`) with
run.json (method, model, the server's URL and pid, the command line) before the server starts,
and the server writes its metrics streams there, so `hack dashboard` with no arguments shows it.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from hack_metrics import rundir


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run an SGLang server with the HACK KV cache (or BF16 with --bf16)")
    p.add_argument("--model", default="smollm2", help="model name for `hack model prepare`")
    p.add_argument("--model-path", default=None, help="an HF folder instead of a prepared model")
    p.add_argument("--bf16", action="store_true", help="the BF16 baseline (torch_native attention) instead")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--run-dir", default=None,
                   help=f"record the run in this directory (default: a new one under {rundir.RUNS_ROOT_HELP})")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, help="-- then options for sglang.launch_server")
    p.set_defaults(func=_serve)


def command(args: argparse.Namespace, model_path: str) -> list[str]:
    extra = list(args.sglang_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    mode = ["--attention-backend", "torch_native"] if args.bf16 else ["--kv-cache-dtype", "hack"]
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--device", "cpu",
            "--host", args.host, "--port", str(args.port), *mode, *extra]


def _extra_value(extra: list[str], flag: str) -> str | None:
    """The value of `flag` among the options passed to SGLang (`--flag v` or `--flag=v`)."""
    for i, a in enumerate(extra):
        if a == flag and i + 1 < len(extra):
            return extra[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def record_run(args: argparse.Namespace, model_path: str, cmd: list[str], pid: int) -> tuple[Path, dict]:
    """Create (or reuse, with --run-dir) the run directory and its run.json; returns it and the
    environment that makes the server write its metrics streams there."""
    extra = cmd[cmd.index("--port") + 2:]  # what follows --port: the mode, then the `--` options
    kv = "bf16" if args.bf16 else "hack"
    host = _extra_value(extra, "--host") or args.host
    port = _extra_value(extra, "--port") or str(args.port)
    meta = {"model": Path(model_path).name if args.model_path else args.model, "model_path": model_path,
            "command": shlex.join(["hack", *sys.argv[1:]]) if sys.argv[1:2] == ["serve"] else None}
    if args.run_dir:
        run_dir = rundir.init_run(args.run_dir, f"serve-{kv}", kv, extra=meta)
    else:
        run_dir = rundir.create_run(f"serve-{kv}", kv, extra=meta)
    rundir.register_server(run_dir, "colocated-0", "colocated", f"http://{host}:{port}", pid=pid)
    env = {"HACK_METRICS_RUN_DIR": str(run_dir), "HACK_METRICS_ROLE": "colocated",
           "HACK_METRICS_INSTANCE": "0",
           "HACK_METRICS_PROMETHEUS": "1" if "--enable-metrics" in extra else "0"}
    return run_dir, env


def _serve(args: argparse.Namespace) -> int:
    if args.model_path:
        model_path = args.model_path
    else:
        from hack_eval.models import prepare

        model_path = str(prepare(args.model, log=lambda m: print(m, file=sys.stderr)))
    cmd = command(args, model_path)
    # The server takes over this process (signals, exit status), so run.json's pid is ours.
    run_dir, env = record_run(args, model_path, cmd, os.getpid())
    print(" ".join(cmd), file=sys.stderr)
    print(f"run directory: {run_dir}", file=sys.stderr)
    os.execve(cmd[0], cmd, {**os.environ, **env})
    return 0  # not reached
