"""`hack up`, `hack down`, `hack demo`: a local prefill/decode cluster behind the PD router."""
from __future__ import annotations

import argparse
import json
import sys

from disagg.server_cmd import METHODS


def _model_path(name: str) -> str:
    from pathlib import Path

    if Path(name).exists():
        return name
    from hack_eval.models import prepare

    return str(prepare(name, log=lambda m: print(m, file=sys.stderr)))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start prefill + decode servers and the PD router on this machine")
    p.add_argument("--model", default="smollm2", help="model name (hack model prepare) or a model folder")
    p.add_argument("--kv", default="hack", choices=list(METHODS), help="KV cache method")
    p.add_argument("--link-mbps", type=float, default=None,
                   help="shape the prefill->decode link to N Mbit/s (root: network namespace + tc tbf)")
    p.add_argument("--prefill", type=int, default=1, help="number of prefill servers")
    p.add_argument("--decode", type=int, default=1, help="number of decode servers")
    p.add_argument("--max-total-tokens", type=int, default=32768, help="KV tokens per server")
    p.add_argument("--run-dir", default=None, help="where logs, metrics and wire logs go")
    p.add_argument("--json", action="store_true", help="print the cluster state as JSON")
    p.set_defaults(func=cmd_up)

    d = sub.add_parser("down", help="stop what `hack up` started and remove its network namespaces")
    d.add_argument("--name", default=None, help="only this cluster (default: all)")
    d.set_defaults(func=cmd_down)

    m = sub.add_parser("demo", help="BF16 then HACK over a shaped link, with the dashboard (make demo)")
    m.add_argument("--model", default="smollm2")
    m.add_argument("--requests", type=int, default=3, help="requests per method")
    m.add_argument("--no-dashboard", action="store_true", help="do not start the dashboard (headless)")
    m.add_argument("--duration", type=float, default=None,
                   help="stop after N seconds instead of waiting for Ctrl-C")
    m.add_argument("--port", type=int, default=8501, help="dashboard port")
    m.set_defaults(func=cmd_demo)


def cmd_up(args: argparse.Namespace) -> int:
    from disagg import cluster

    spec = cluster.ClusterSpec(model_path=_model_path(args.model), kv=args.kv,
                               link_mbps=args.link_mbps, prefill=args.prefill, decode=args.decode,
                               max_total_tokens=args.max_total_tokens, run_dir=args.run_dir)
    if args.link_mbps is not None:
        from disagg import netns

        ok, why = netns.can_shape()
        if not ok:
            raise RuntimeError(f"--link-mbps: {why}")
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    log(f"starting {args.prefill} prefill + {args.decode} decode ({args.kv}) "
        f"{'over a ' + format(args.link_mbps, 'g') + ' Mbit/s link' if args.link_mbps else 'on loopback'} ...")
    state = cluster.up(spec, log=log)
    cluster.detach(state)
    if args.json:
        print(json.dumps(state, indent=1))
    else:
        print(f"router:  {state['router_url']}")
        print(f"run dir: {state['run_dir']}")
        print("stop with: hack down")
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
    from disagg import demo

    return demo.run(_model_path(args.model), requests=args.requests, dashboard=not args.no_dashboard,
                    duration_s=args.duration, port=args.port)
