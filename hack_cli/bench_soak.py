"""`hack bench soak`: a bounded load on a local xPyD cluster behind the PD router, malformed
requests interleaved, faults on a schedule (disagg/soak.py says what is measured and how a
failure is classified). One fresh cluster per KV method, the same seeded load for each; the
properties the report must hold are printed and decide the exit status (1 when one fails)."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from disagg.server_cmd import METHODS

from .bench_doc import command_line


def register(bsub: argparse._SubParsersAction) -> None:
    from .cmd_cluster import MODEL_HELP, add_router_args

    p = bsub.add_parser("soak", help="sustained mixed load on an xPyD cluster with malformed requests and "
                                     "faults (kill a prefill, corrupt a transfer, kill a decode)")
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    p.add_argument("--kv", default="hack",
                   help=f"comma-separated KV methods, one cluster each ({', '.join(METHODS)}); e.g. bf16,hack")
    p.add_argument("--prefill", type=int, default=2, help="prefill servers")
    p.add_argument("--decode", type=int, default=2, help="decode servers")
    p.add_argument("--requests", type=int, default=500, help="generation requests")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--long-fraction", type=float, default=0.1,
                   help="share of long documents (essays) among the requests; the rest are ShareGPT chat prompts")
    p.add_argument("--long-tokens", type=int, default=2048, help="tokens of a long document")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (at most)")
    p.add_argument("--bad-every", type=int, default=10,
                   help="one malformed request after every N generation requests (0: none)")
    p.add_argument("--faults", default="none",
                   help="'none', 'default' (kill-prefill@0.3,corrupt-transfer@0.5,kill-decode@0.7) or "
                        "a comma-separated list of KIND@FRACTION (kinds: kill-prefill, corrupt-transfer, "
                        "kill-decode; the fraction of the requests at which it fires), and the link faults "
                        "partition:SECONDS@FRACTION and loss:PERCENT@FRACTION on each prefill's link "
                        "(need --link-mbps; a loss lasts to the end of the load)")
    p.add_argument("--link-mbps", type=float, default=None, help="shape each prefill's link (root)")
    p.add_argument("--kv-budget-mb", type=float, default=None,
                   help="KV pool budget per server, any method (default: the cluster's, 768 MB); "
                        "smaller budgets show the capacity difference as retractions")
    p.add_argument("--max-total-tokens", type=int, default=32768, help="KV tokens per server (upper bound)")
    p.add_argument("--max-running-requests", type=int, default=None,
                   help="requests a server runs at once, every method alike (SGLang's flag; for HACK also its "
                        "request rows: without it HACK's rows take at most 12.5%% of the budget)")
    p.add_argument("--num-reserved-decode-tokens", type=int, default=None,
                   help="decode tokens SGLang reserves per request when it admits one (its flag, default 512): "
                        "with outputs longer than this, a tight budget makes decode retract")
    p.add_argument("--decode-extra-slots", type=int, default=None,
                   help="request rows a decode server pre-allocates for arriving transfers (SGLang's "
                        "--disaggregation-decode-extra-slots; its default is 2x --max-running-requests up to 32); "
                        "HACK reserves FP16 tails for each")
    p.add_argument("--out", default="docs/bench/soak.json", help="write the JSON reports here")
    add_router_args(p)
    p.set_defaults(func=run_cli)


def run_default(args: argparse.Namespace) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register(sub)
    return run_cli(parser.parse_args(["soak", "--faults", "default"]))


def _print(report: dict) -> None:
    r, m = report["requests"], report["malformed"]
    c = report["cluster"]
    print(f"[{c['kv']}] {c['prefill']}P{c['decode']}D ({c['router']} router), {report['wall_s']} s: "
          f"{r['ok']}/{r['sent']} ok, {r['failed']} failed ({r['expected_failures']} expected); "
          f"malformed {m['answered_4xx']}/{m['sent']} answered 4xx")
    print(f"  failures by class: {report['failures']}")
    for ph in report["phases"]:
        j, t = ph["jct_s"], ph["ttft_s"]
        fmt = (lambda s: "-" if s["p50"] is None else f"{s['p50']:.2f}/{s['p99']:.2f}")
        print(f"  after {ph['after']:<17} sent {ph['sent']:>4} ok {ph['ok']:>4}  JCT p50/p99 {fmt(j)} s  "
              f"TTFT p50/p99 {fmt(t)} s")
    for ev in report["faults"]:
        print(f"  fault {ev['fault']} {ev['server']}: " + ", ".join(
            f"{k}={ev[k]}" for k in ("arg", "in_flight", "in_flight_served", "in_flight_failed",
                                     "last_in_flight_ended_after_s", "dropped_packets", "in_flight_errors",
                                     "sent_after", "failed_after", "failed_after_within_s", "first_served_after_s",
                                     "router_dropped_after_s", "router_view", "consumed") if k in ev))
    if report.get("server_allocator"):
        print(f"  servers' allocator: {report['server_allocator']}")
    for name, x in report["rss"].items():
        print(f"  {name}: RSS {x['start_mb']} -> {x['at_100_mb']} (100th) -> {x['end_mb']} MB"
              f"{' (killed)' if x['dead'] else ''}; at each tenth of the load: "
              f"{', '.join(f'{v:.0f}' for v in x.get('by_tenth_mb', []))}")
    print(f"  pools idle after: {report['pools']['idle_after']}; retractions: {report['retractions']}")
    for name, d in (report.get("decode_pressure") or {}).items():
        if d:
            print(f"  {name}: running mean/max {d['running_mean']}/{d['running_max']}, waiting for admission "
                  f"(prealloc queue) mean/max {d['prealloc_queue_mean']}/{d['prealloc_queue_max']}, peak KV usage "
                  f"{d['kv_usage_max']:.2f} ({d['batches_logged']} logged batches)")


def run_cli(args: argparse.Namespace) -> int:
    from disagg import cluster
    from disagg.soak import DEFAULT_FAULTS, Soak, SoakSpec, fault_schedule, passed

    from .cmd_cluster import _model_path, router_options_from_args

    methods = [m.strip() for m in args.kv.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"--kv: unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    faults = fault_schedule(DEFAULT_FAULTS if args.faults == "default" else
                            None if args.faults == "none" else args.faults)
    spec = SoakSpec(requests=args.requests, concurrency=args.concurrency, seed=args.seed,
                    long_fraction=args.long_fraction, long_tokens=args.long_tokens,
                    chat_max_tokens=args.max_tokens, bad_every=args.bad_every, faults=faults)
    spec.validate(args.prefill, args.decode, shaped_link=args.link_mbps is not None)  # before any server starts
    router = router_options_from_args(args)
    model_path = _model_path(args.model)
    extra = ["--hack-kv-budget-mb", f"{args.kv_budget_mb:g}"] if args.kv_budget_mb else []
    # our flag, its value, the least it may be, the SGLang server flag it becomes
    for flag, value, least, server_flag in (
            ("--max-running-requests", args.max_running_requests, 1, "--max-running-requests"),
            ("--num-reserved-decode-tokens", args.num_reserved_decode_tokens, 0, "--num-reserved-decode-tokens"),
            ("--decode-extra-slots", args.decode_extra_slots, 0, "--disaggregation-decode-extra-slots")):
        if value is None:
            continue
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
        extra += [server_flag, str(value)]
    out = {"command": command_line("soak"), "date": time.strftime("%Y-%m-%d"), "model": args.model, "runs": []}
    broken: list[str] = []
    for method in methods:
        cspec = cluster.ClusterSpec(model_path=model_path, model=args.model, kv=method, link_mbps=args.link_mbps,
                                    prefill=args.prefill, decode=args.decode,
                                    max_total_tokens=args.max_total_tokens, extra_server_args=extra,
                                    label=f"soak-{method}", router=router,
                                    command=shlex.join(["hack", *sys.argv[1:]]))
        print(f"[{method}] starting {args.prefill}P{args.decode}D ...", flush=True)
        state = cluster.up(cspec, log=lambda m: print(m, flush=True))
        try:
            report = Soak(state, spec, model_path, log=lambda m: print(m, flush=True)).run()
        finally:
            cluster.down(state)
        report["run_dir"] = state["run_dir"]
        report["problems"] = passed(report)
        out["runs"].append(report)
        _print(report)
        broken += [f"[{method}] {p}" for p in report["problems"]]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    if len(out["runs"]) > 1:
        base = out["runs"][0]
        for r in out["runs"][1:]:
            print(f"{r['cluster']['kv']} vs {base['cluster']['kv']}: retractions "
                  f"{sum(r['retractions'].values())} vs {sum(base['retractions'].values())}; "
                  f"JCT p50 {r['phases'][0]['jct_s']['p50']} vs {base['phases'][0]['jct_s']['p50']} s")
    print(f"wrote {args.out}")
    for line in broken:
        print(f"PROPERTY BROKEN: {line}")
    return 1 if broken else 0
