"""`hack up`, `hack status`, `hack down`, `hack demo`: a local prefill/decode cluster behind
the PD router."""
from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from engine.args import LAYER_SPEC_METAVAR, fraction, layer_list
from engine.layer_sets import resolve_for_model_path
from disagg.server_cmd import METHODS
from hack_eval.models import MODELS
from hack_metrics.rundir import RUNS_ROOT_HELP
from hack_ops.config import RaisedTensors

if TYPE_CHECKING:
    from disagg.cluster import ClusterSpec
    from disagg.router import RouterOptions

MODEL_HELP = f"model name ({', '.join(MODELS)}; prepared once, as `hack model prepare` does) or a model folder"


def _model_path(name: str) -> str:
    from pathlib import Path

    if Path(name).exists():
        return name
    from hack_eval.models import prepare

    return str(prepare(name, log=lambda m: print(m, file=sys.stderr)))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start prefill + decode servers and the PD router on this machine")
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    p.add_argument("--kv", default="hack", choices=list(METHODS),
                   help="KV cache method (hack sends its pages without K's code sums and the unread open "
                        "page, --hack-kv-codec hack-pages; hack-full-pages sends every page as stored)")
    p.add_argument("--4bit-layers", dest="four_bit_layers", type=layer_list, default=None,
                   metavar=LAYER_SPEC_METAVAR,
                   help="with a HACK --kv method: these 0-based layers' pages at 4 bits on both sides "
                        "(--hack-4bit-layers; e.g. the layers `hack eval retrieval --needle-attention` names, "
                        "'full': the model's layers without a sliding window, 'none': every layer at 2 bits; "
                        "default: the servers' 'auto', a window model's few full layers)")
    p.add_argument("--4bit-tensors", dest="four_bit_tensors", choices=[t.value for t in RaisedTensors], default="kv",
                   help="with --4bit-layers: kv (K and V at 4 bits, default), k (K alone) or v (V alone; "
                        "--hack-4bit-tensors)")
    p.add_argument("--static-keep", dest="static_keep", type=fraction, default=None, metavar="FRACTION",
                   help="with a HACK --kv method: look-once static eviction on both servers (--hack-static-keep): "
                        "the prefill server keeps this fraction of each prompt's closed pages per layer and sends "
                        "only those; the decode server reads only those")
    p.add_argument("--link-mbps", type=float, default=None,
                   help="shape the prefill->decode link to N Mbit/s (root: network namespace + tc tbf)")
    p.add_argument("--prefill", type=int, default=1, help="number of prefill servers")
    p.add_argument("--decode", type=int, default=1, help="number of decode servers")
    p.add_argument("--max-total-tokens", type=int, default=32768, help="KV tokens per server")
    p.add_argument("--run-dir", default=None,
                   help="where logs, metrics and wire logs go (default: a new directory under "
                        f"the runs root, {RUNS_ROOT_HELP})")
    p.add_argument("--enable-metrics", action="store_true",
                   help="SGLang's Prometheus /metrics on every server, with the hack:* metrics")
    p.add_argument("--page-tier", default=None, metavar="DIR",
                   help="the prefill servers keep their radix cache's pages in DIR too (--hack-page-tier, shared "
                        "by every prefill): a prefix evicted from a prefill's pool comes back from disk")
    add_router_args(p)
    p.add_argument("--foreground", action="store_true",
                   help="stay attached: stop everything on Ctrl-C or SIGTERM")
    p.add_argument("--json", action="store_true", help="print the cluster state as JSON")
    p.set_defaults(func=cmd_up)

    s = sub.add_parser("status", help="clusters started by `hack up`: servers, health, link, run dir")
    s.add_argument("--json", action="store_true", help="print the status as JSON")
    s.set_defaults(func=cmd_status)

    d = sub.add_parser("down", help="stop what `hack up` started and remove its network namespaces")
    d.add_argument("--name", default=None, help="only this cluster (default: all)")
    d.set_defaults(func=cmd_down)

    m = sub.add_parser("demo", help="BF16 then HACK over a shaped link, with the dashboard (make demo)")
    m.add_argument("--model", default="smollm2", help=MODEL_HELP)
    m.add_argument("--requests", type=int, default=3, help="requests per method")
    m.add_argument("--no-dashboard", action="store_true", help="do not start the dashboard (headless)")
    m.add_argument("--duration", type=float, default=None,
                   help="stop after N seconds instead of waiting for Ctrl-C")
    m.add_argument("--port", type=int, default=8501, help="dashboard port")
    m.set_defaults(func=cmd_demo)


def add_router_args(p: argparse.ArgumentParser) -> None:
    """The router flags of `hack up` (and of the commands that start a cluster the same way)."""
    from disagg.router import POLICIES, RouterKind

    g = p.add_argument_group("router", "the PD router in front of the servers (disagg/router.py)")
    g.add_argument("--router", default=RouterKind.RUST.value, choices=[k.value for k in RouterKind],
                   help="rust: SGLang's production router (health checks, retries with backoff, "
                        "circuit breaker, routing policies; default); mini-lb: SGLang's small "
                        "Python balancer, none of those")
    g.add_argument("--router-policy", default=None, choices=POLICIES,
                   help="routing policy of both roles (default: the router's, cache_aware)")
    g.add_argument("--router-prefill-policy", default=None, choices=POLICIES,
                   help="routing policy of the prefill servers")
    g.add_argument("--router-decode-policy", default=None, choices=POLICIES,
                   help="routing policy of the decode servers")
    g.add_argument("--router-health-interval", type=int, default=2, metavar="S",
                   help="seconds between the router's health checks of each server (default 2)")
    g.add_argument("--router-retries", type=int, default=5,
                   help="retries of a failed request, each routed anew (0: none; default 5)")
    g.add_argument("--router-retry-backoff-ms", type=int, default=1000, metavar="MS",
                   help="wait before the first retry; doubles, up to 8 s (default 1000: five "
                        "retries span 23 s, longer than a dead server stays in rotation)")
    g.add_argument("--router-arg", action="append", default=[], metavar="FLAG",
                   help="one more flag for sglang_router.launch_router, verbatim (repeatable; "
                        "use --router-arg=--flag=value)")


def router_options_from_args(args: argparse.Namespace) -> "RouterOptions":
    from disagg.router import RouterKind, RouterOptions

    opts = RouterOptions(kind=RouterKind(args.router), policy=args.router_policy,
                         prefill_policy=args.router_prefill_policy,
                         decode_policy=args.router_decode_policy,
                         health_check_interval_s=args.router_health_interval,
                         retries=args.router_retries,
                         retry_backoff_ms=args.router_retry_backoff_ms,
                         retry_max_backoff_ms=max(8000, args.router_retry_backoff_ms),
                         extra=tuple(args.router_arg))
    opts.validate()
    for warning in opts.warnings():
        print(f"warning: {warning}", file=sys.stderr)
    return opts


class Stopped(Exception):
    """SIGTERM or Ctrl-C while `hack up` runs in the foreground (or is still starting)."""


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn the first SIGTERM/SIGINT into `Stopped` (so the caller's cleanup runs), and ignore
    further ones while that cleanup stops the servers."""
    def handler(signum: int, _frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise Stopped(signal.Signals(signum).name)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def spec_from_args(args: argparse.Namespace) -> "ClusterSpec":
    """The ClusterSpec `hack up` starts (the model prepared by name, or a folder as given)."""
    from disagg import cluster

    extra: list[str] = []
    layers = getattr(args, "four_bit_layers", None)
    if getattr(args, "four_bit_tensors", "kv") != "kv" and not layers:
        raise ValueError(f"--4bit-tensors {args.four_bit_tensors} says which tensors of the --4bit-layers layers take "
                         "4 bits; give --4bit-layers too")
    if layers:
        if not args.kv.startswith("hack") and args.kv != "dequant":
            raise ValueError(f"--4bit-layers sets HACK page bits; --kv {args.kv} has no HACK pages")
        layers = resolve_for_model_path(layers, _model_path(args.model))  # 'full', 'auto': the model's indices
        extra = ["--hack-4bit-layers", ",".join(map(str, layers)) or "none"]
        if getattr(args, "four_bit_tensors", "kv") != "kv":
            extra += ["--hack-4bit-tensors", args.four_bit_tensors]
    keep = getattr(args, "static_keep", None)
    if keep is not None and keep < 1:
        if not args.kv.startswith("hack"):
            raise ValueError(f"--static-keep drops HACK pages from decode's reads; --kv {args.kv} has none")
        extra += ["--hack-static-keep", f"{keep:g}"]
    return cluster.ClusterSpec(model_path=_model_path(args.model), model=args.model, kv=args.kv,
                               extra_server_args=extra,
                               link_mbps=args.link_mbps, prefill=args.prefill, decode=args.decode,
                               max_total_tokens=args.max_total_tokens, run_dir=args.run_dir,
                               command=shlex.join(["hack", *sys.argv[1:]]),
                               enable_metrics=args.enable_metrics, page_tier=args.page_tier,
                               router=router_options_from_args(args))


def cmd_up(args: argparse.Namespace) -> int:
    from disagg import cluster

    spec = spec_from_args(args)
    if args.link_mbps is not None:
        from disagg import netns

        ok, why = netns.can_shape()
        if not ok:
            raise RuntimeError(f"--link-mbps: {why}")
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    log(f"starting {args.prefill} prefill + {args.decode} decode ({args.kv}) "
        f"{'over a ' + format(args.link_mbps, 'g') + ' Mbit/s link' if args.link_mbps else 'on loopback'} ...")
    try:
        with stop_on_signals():
            # up() stops what it started when interrupted (its own cleanup on any exception).
            state = cluster.up(spec, log=log)
            if not args.foreground:
                cluster.detach(state)
            if args.json:
                print(json.dumps(state, indent=1), flush=True)
            else:
                print(f"router:  {state['router_url']}  ({state.get('router', 'rust')})")
                print(f"run dir: {state['run_dir']}")
                print("dashboard: hack dashboard   (status: hack status)")
                print("stop with: " + ("Ctrl-C" if args.foreground else "hack down"), flush=True)
            if not args.foreground:
                return 0
            try:
                while True:
                    time.sleep(0.5)
            except Stopped:
                log("stopping ...")
                for line in cluster.down(state):
                    log(f"{state['name']}: {line}")
                return 0
    except Stopped as exc:
        print(f"hack up: {exc} during startup; stopped what was started", file=sys.stderr)
        return 128 + signal.Signals[str(exc)].value


def _fmt_time(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def cmd_status(args: argparse.Namespace) -> int:
    from disagg import cluster

    report = [cluster.status(st) for st in cluster.load_states()]
    if args.json:
        print(json.dumps({"state_dir": str(cluster.state_dir()), "clusters": report}, indent=1))
        return 0
    if not report:
        print(f"no clusters (state in {cluster.state_dir()}); start one with `hack up`")
        return 0
    for c in report:
        link = (f"{c['link_mbps']:g} Mbit/s ({', '.join(c['namespaces'])})" if c["link_mbps"]
                else "loopback")
        print(f"cluster {c['name']}: {c['state'].upper()}  kv {c['kv']}  link {link}")
        print(f"  router  {c['router_url'] or '-'}   started {_fmt_time(c['started'])}")
        print(f"  run dir {c['run_dir']}")
        print(f"  {'server':<10} {'pid':>8}  {'health':<14} url")
        for s in c["servers"]:
            print(f"  {s['role'] + '-' + str(s['index']):<10} {s['pid']:>8}  {s['health']:<14} {s['url']}")
        for p in c["problems"]:
            print(f"  problem: {p}")
        if c["state"] == "stale":
            print(f"  stale: no process of it is alive; `hack down --name {c['name']}` removes it")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from disagg import cluster

    states = [s for s in cluster.load_states() if args.name in (None, s["name"])]
    if args.name and not states:
        raise ValueError(f"no cluster named {args.name}")
    for st in states:
        lines = cluster.down(st) or ["already stopped; state removed"]
        for line in lines:
            print(f"{st['name']}: {line}")
    if args.name is None:
        for line in cluster.clean_stale():
            print(line)
    if not states:
        print("nothing to stop")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.run(_model_path(args.model), requests=args.requests, dashboard=not args.no_dashboard,
                    duration_s=args.duration, port=args.port)
