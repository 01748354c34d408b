"""`hack serve`: one SGLang server with the HACK KV cache on the default model.

Equivalent to `python -m sglang.launch_server --model-path "$(hack model prepare smollm2)"
--kv-cache-dtype hack --device cpu ...`; options after `--` go to SGLang unchanged (they are
validated there, e.g. `-- --hack-partition-size 32 --port 30001`).

Like `hack up`, it records a run: a new run directory under the runs root (or `--run-dir`) with
run.json (method, model, the server's URL and pid, the command line) before the server starts,
and the server writes its metrics streams there, so `hack dashboard` with no arguments shows it.

`--role prefill|decode` starts one half of a disaggregated pair with the flags and environment
`hack up` gives it (disagg.server_command, disagg.cluster.server_env): what a container of the
compose stack runs (docker/compose.cpu.yaml), where each server is its own process tree and
host. There `--join` lets the servers of one stack record into one run directory, and
`--advertise-host auto` is the address the other containers reach this one by.
"""
from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
from enum import Enum
from pathlib import Path

from hack_metrics import rundir


class ServeRole(str, Enum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


# The prefill's bootstrap port when none is given (SGLang's own default).
DEFAULT_BOOTSTRAP_PORT = 8998


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run an SGLang server with the HACK KV cache (or BF16 with --bf16)")
    p.add_argument("--model", default="smollm2", help="model name for `hack model prepare`")
    p.add_argument("--model-path", default=None, help="an HF folder instead of a prepared model")
    p.add_argument("--bf16", action="store_true", help="the BF16 baseline (torch_native attention) instead")
    p.add_argument("--kv", choices=("hack", "bf16"), default="hack",
                   help="the KV cache: hack (default) or bf16 (the same as --bf16)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--run-dir", default=None,
                   help=f"record the run in this directory (default: a new one under {rundir.RUNS_ROOT_HELP})")
    p.add_argument("--role", type=ServeRole, choices=list(ServeRole), default=ServeRole.COLOCATED,
                   metavar="{" + ",".join(r.value for r in ServeRole) + "}",
                   help="colocated (default), or one half of a prefill/decode pair with the flags `hack up` uses")
    p.add_argument("--bootstrap-port", type=int, default=DEFAULT_BOOTSTRAP_PORT,
                   help="--role prefill: the port decode servers fetch transfer sessions from")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="--role prefill/decode: the KV pool size in tokens (default: as `hack up`)")
    p.add_argument("--advertise-host", default=None,
                   help="--role prefill/decode: the address peers reach this server by (default: --host; "
                   "'auto': this host's own address, e.g. a container's)")
    p.add_argument("--instance", type=int, default=0, help="this server's index among its role's (run.json)")
    p.add_argument("--join", action="store_true",
                   help="with --run-dir: add this server to the run recorded there instead of starting a new run")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, help="-- then options for sglang.launch_server")
    p.set_defaults(func=_serve)


def _kv(args: argparse.Namespace) -> str:
    return "bf16" if args.bf16 or getattr(args, "kv", "hack") == "bf16" else "hack"


def _role(args: argparse.Namespace) -> ServeRole:
    return ServeRole(getattr(args, "role", ServeRole.COLOCATED))


def _sglang_args(args: argparse.Namespace) -> list[str]:
    extra = list(args.sglang_args)
    extra = extra[1:] if extra and extra[0] == "--" else extra
    # An empty word is what a compose file's unset `${..._ARGS:-}` becomes under podman-compose;
    # SGLang would refuse it as an unrecognized argument.
    return [a for a in extra if a != ""]


def advertised_host(args: argparse.Namespace) -> str:
    """The address a prefill/decode server gives its peers (SGLANG_HOST_IP, run.json)."""
    host = getattr(args, "advertise_host", None) or args.host
    if host == "auto" or host in ("0.0.0.0", "::"):
        # The name this host (a container: its hostname) resolves to is the address the other
        # hosts of its network reach it by.
        return socket.gethostbyname(socket.gethostname())
    return host


def command(args: argparse.Namespace, model_path: str) -> list[str]:
    extra = _sglang_args(args)
    role = _role(args)
    if role is not ServeRole.COLOCATED:
        from disagg.cluster import ClusterSpec
        from disagg.server_cmd import server_command

        tokens = getattr(args, "max_total_tokens", None) or ClusterSpec.max_total_tokens
        bport = args.bootstrap_port if role is ServeRole.PREFILL else None
        return server_command(role.value, _kv(args), model_path, args.host, args.port,
                              bport, tokens, extra)
    mode = ["--attention-backend", "torch_native"] if _kv(args) == "bf16" else ["--kv-cache-dtype", "hack"]
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
    role = _role(args)
    if role is ServeRole.COLOCATED:
        pd_only = [flag for flag, given in (("--advertise-host", getattr(args, "advertise_host", None)),
                                            ("--max-total-tokens", getattr(args, "max_total_tokens", None)),
                                            ("--bootstrap-port", getattr(args, "bootstrap_port", DEFAULT_BOOTSTRAP_PORT)
                                             != DEFAULT_BOOTSTRAP_PORT)) if given]
        if pd_only:
            raise ValueError(f"{', '.join(pd_only)}: only for --role prefill or decode (a colocated server takes "
                             "SGLang's own options after --)")
    extra = _sglang_args(args)
    kv = _kv(args)
    meta = {"model": Path(model_path).name if args.model_path else args.model, "model_path": model_path,
            "command": shlex.join(["hack", *(a for a in sys.argv[1:] if a)]) if sys.argv[1:2] == ["serve"] else None}
    label = f"serve-{kv}" if role is ServeRole.COLOCATED else f"pd-{kv}"
    if getattr(args, "join", False) and not args.run_dir:
        raise ValueError("--join needs --run-dir: the run directory the stack's servers share")
    if args.run_dir:
        run_dir = rundir.init_run(args.run_dir, label, kv, extra=meta, join=getattr(args, "join", False))
    else:
        run_dir = rundir.create_run(label, kv, extra=meta)
    instance = getattr(args, "instance", 0)
    if role is ServeRole.COLOCATED:
        host = _extra_value(extra, "--host") or args.host
        port = _extra_value(extra, "--port") or str(args.port)
        rundir.register_server(run_dir, "colocated-0", "colocated", f"http://{host}:{port}", pid=pid)
        env = {"HACK_METRICS_RUN_DIR": str(run_dir), "HACK_METRICS_ROLE": "colocated",
               "HACK_METRICS_INSTANCE": "0",
               "HACK_METRICS_PROMETHEUS": "1" if "--enable-metrics" in extra else "0"}
        return run_dir, env
    from disagg.cluster import ClusterSpec, link_rate_label, server_env

    shaped = os.environ.get("HACK_LINK_MBPS")
    if role is ServeRole.PREFILL and shaped:
        # The rate the CPU image's entry point shaped this host's egress to (docker/entrypoint.sh):
        # the link the run's KV crosses, shown by the dashboard.
        rundir.update_run(run_dir, link_rate=link_rate_label(float(shaped)))
    host = advertised_host(args)
    rundir.register_server(run_dir, f"{role.value}-{instance}", role.value, f"http://{host}:{args.port}",
                           pid=pid, **({"bootstrap_port": args.bootstrap_port} if role is ServeRole.PREFILL else {}))
    env = server_env(host, run_dir, role.value, instance, waiting_timeout_s=ClusterSpec.waiting_timeout_s,
                     enable_metrics="--enable-metrics" in extra)
    return run_dir, env


def _serve(args: argparse.Namespace) -> int:
    if args.model_path:
        model_path = args.model_path
    else:
        from hack_eval.models import prepare

        model_path = str(prepare(args.model, log=lambda m: print(m, file=sys.stderr)))
    cmd = command(args, model_path)
    # The server takes over this process (signals, exit status), so run.json's pid is ours.
    try:
        run_dir, env = record_run(args, model_path, cmd, os.getpid())
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(" ".join(cmd), file=sys.stderr)
    print(f"run directory: {run_dir}", file=sys.stderr)
    os.execve(cmd[0], cmd, {**os.environ, **env})
    return 0  # not reached
