"""`hack bench fuzz`: the schema fuzzer (disagg.schema_fuzz: schemathesis, from the server's own
/openapi.json) at full budget against a colocated HACK server, a colocated BF16 server and the PD
router of a 1P1D HACK cluster, one after the other, the same requests to each
(disagg.fuzz_run says what each must still be afterwards). Prints a table, writes the JSON and
the docs/reliability.md block; exit status 1 when a 5xx, a dropped connection, a death, a
leaked pool or an ejected worker was seen."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from .bench_doc import DOCS, command_line, replace_block
from .cmd_cluster import MODEL_HELP

DOC = DOCS / "reliability.md"
DOC_BLOCK = "fuzz"


def register(bsub: argparse._SubParsersAction) -> None:
    from disagg.fuzz_run import Target

    p = bsub.add_parser("fuzz", help="schema fuzzing (schemathesis) of every generation endpoint: HACK, BF16 "
                                     "and the PD router; no 5xx, no death, pools idle, no worker ejected")
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    p.add_argument("--per-endpoint", type=int, default=5000, help="generated requests per endpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--targets", default=",".join(t.value for t in Target),
                   help=f"comma-separated, in order ({', '.join(t.value for t in Target)})")
    p.add_argument("--paths", default=None,
                   help="only these endpoints (comma-separated paths; default: every fuzzed endpoint "
                        "of the server's OpenAPI document, disagg/fuzz_scope.py)")
    p.add_argument("--out", default="docs/bench/fuzz.json", help="write the JSON result here")
    p.add_argument("--no-doc", action="store_true", help="do not update docs/reliability.md")
    p.set_defaults(func=run_cli)


def run_default(args: argparse.Namespace) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return run_cli(parser.parse_args(["fuzz"]))


def _targets(text: str) -> list[Any]:
    from disagg.fuzz_run import Target

    out = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        try:
            out.append(Target(name))
        except ValueError:
            raise ValueError(f"--targets: {name!r} is not one of {', '.join(t.value for t in Target)}") from None
    if not out:
        raise ValueError("--targets names no target")
    return out


def run_cli(args: argparse.Namespace) -> int:
    from disagg import cluster, procs
    from disagg.fuzz_run import COLOCATED_ARGS, Target, TargetRun, fuzz_target, router_problems, server_problems
    from disagg.schema_fuzz import Budget, build_requests, fetch_document, same_api
    from engine.launcher import SGLangServer

    from .cmd_cluster import _model_path

    if args.per_endpoint < 1:
        raise ValueError(f"--per-endpoint must be >= 1, got {args.per_endpoint}")
    targets = _targets(args.targets)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()] if args.paths else None
    model_path = _model_path(args.model)
    budget = Budget(per_endpoint=args.per_endpoint, seed=args.seed)
    log = lambda m: print(m, flush=True)  # noqa: E731
    out: dict[str, Any] = {"command": command_line("fuzz"), "date": time.strftime("%Y-%m-%d"),
                           "model": args.model, "per_endpoint": args.per_endpoint, "seed": args.seed, "runs": []}
    state: dict[str, Any] = {}  # the document and requests, built from the first server started

    def requests_for(url: str, same_document: bool = True) -> dict:
        """The run's requests, built from the first server's document; a later colocated server must
        describe the same API. A PD server need not (its mode changes what SGLang registers): the
        router gets the same requests as the colocated targets."""
        doc = fetch_document(url)
        if "doc" not in state:
            t0 = time.monotonic()
            state.update(doc=doc, requests=build_requests(doc, budget, paths, log=log))
            out["generation_s"] = round(time.monotonic() - t0, 1)
        elif same_document and not same_api(doc, state["doc"]):
            raise RuntimeError(f"{url}/openapi.json differs from the first server's: the same requests "
                               "cannot go to both")
        return state["requests"]

    for target in targets:
        t0 = time.monotonic()
        if target is Target.ROUTER:
            spec = cluster.ClusterSpec(model_path=model_path, model=args.model, kv="hack",
                                       max_total_tokens=16384, waiting_timeout_s=60,
                                       extra_server_args=["--sleep-on-idle"], label="bench-fuzz-router")
            log("[router] starting a 1P1D HACK cluster ...")
            pd = cluster.up(spec, log=log)
            try:
                servers = [s for s in pd["servers"] if s["role"] in ("prefill", "decode")]
                reqs = requests_for(servers[0]["url"], same_document=False)
                alive = lambda: all(procs.alive(int(s["pid"])) for s in pd["servers"])  # noqa: E731
                run = TargetRun(target)
                for path, items in reqs.items():
                    run.endpoints.update(fuzz_target(target, pd["router_url"], {path: items}, alive, log).endpoints)
                    run.problems += [f"after {path}: {p}" for p in router_problems(pd["router_url"], len(servers))]
                for s in servers:
                    run.problems += server_problems(s["role"], s["url"], lambda pid=int(s["pid"]): procs.alive(pid),
                                                    generate_url=pd["router_url"])  # PD: through the router
            finally:
                cluster.down(pd)
        else:
            log(f"[{target.value}] starting a colocated server ...")
            srv = SGLangServer(model_path, COLOCATED_ARGS[target]).start()
            try:
                srv.wait_ready()
                reqs = requests_for(srv.url)
                alive = lambda: srv.proc.poll() is None  # noqa: E731
                run = fuzz_target(target, srv.url, reqs, alive, log)
                run.problems += server_problems(f"the {target.value} server", srv.url, alive)
            finally:
                srv.stop()
        report = run.to_dict()
        report["wall_s"] = round(time.monotonic() - t0, 1)
        out["runs"].append(report)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(render(out))
    if not args.no_doc:
        replace_block(DOC, DOC_BLOCK, render(out), heading="## Schema fuzzing: `hack bench fuzz`")
    print(f"wrote {args.out}")
    broken = [f"[{r['target']}] {line}" for r in out["runs"] for line in _failures(r)]
    for line in broken[:40]:
        print(f"PROPERTY BROKEN: {line}")
    return 1 if broken else 0


def _failures(report: dict) -> list[str]:
    out = [f"{p}: {f}" for p, e in report["endpoints"].items() for f in e["failures"]]
    out += [f"{p}: the server died after {e['died_after']}" for p, e in report["endpoints"].items() if e["died_after"]]
    return out + report["problems"]


def render(result: dict) -> str:
    """The docs table: per target and endpoint, requests and their statuses."""
    lines = [f"Command: `{result['command']}`  ",
             f"Measured: {result['date']} on this project's CPU host (2 shared cores); "
             f"{result['per_endpoint']} generated requests per endpoint, seed {result['seed']}"
             + (f", generated in {result['generation_s']} s" if "generation_s" in result else "") + ".", "",
             "| target | endpoint | requests | 2xx | 4xx | 5xx | no answer | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        for path, e in run["endpoints"].items():
            st = {int(k): v for k, v in e["statuses"].items()}
            count = lambda lo, hi: sum(v for k, v in st.items() if lo <= k < hi)  # noqa: E731
            lines.append(f"| {run['target']} | `{path}` | {e['sent']} | {count(200, 300)} | {count(400, 500)} "
                         f"| {count(500, 600)} | {st.get(0, 0)} | {e['seconds']} |")
    lines.append("")
    for run in result["runs"]:
        problems = _failures(run)
        lines.append(f"- {run['target']}: {run['requests']} requests in {run['wall_s']} s (server start "
                     f"included); " + ("no 5xx, no dropped connection, " + _after(run["target"])
                                       if not problems else f"{len(problems)} problem(s): "
                                       + "; ".join(_short(p) for p in problems[:5])
                                       + ("" if len(problems) <= 5 else "; the rest in the JSON")))
    return "\n".join(lines)


def _short(problem: str, limit: int = 240) -> str:
    """A problem as the doc lists it (the JSON keeps the whole failing body to replay it)."""
    return problem if len(problem) <= limit else problem[:limit] + " ..."


def _after(target: str) -> str:
    if target == "router":
        return "both workers still counted healthy after every endpoint, both servers alive and idle"
    return "the server alive, healthy, generating and its pool idle afterwards"
