"""`hack demo`: the whole product in one command.

Prepares the default model, starts a BF16 pair and replays a short workload, then a HACK pair
with the same workload (so the comparison is on screen), over a shaped link when running as
root (else on loopback, said plainly). Both runs write into one run directory that the operator
dashboard shows; the HACK cluster keeps serving until Ctrl-C (or --duration), then everything
is stopped.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from disagg import cluster, netns, procs
from disagg.replay import replay, summarize
from hack_eval.workloads import build, tokenizer

DEMO_LINK_MBPS = 100.0


def _line(method: str, s: dict) -> str:
    f = lambda v: "n/a" if v is None else f"{v:6.2f}s"  # noqa: E731
    return (f"  {method:<6} ok {s['ok']}/{s['requests']}  mean JCT {f(s['jct_s']['mean'])}  "
            f"mean TTFT {f(s['ttft_s']['mean'])}")


def run(model_path: str, requests: int = 3, rps: float = 0.2, dashboard: bool = True,
        duration_s: float | None = None, port: int = 8501, log: Callable[[str], None] = print) -> int:
    shaped, why = netns.can_shape()
    link = DEMO_LINK_MBPS if shaped else None
    if not shaped:
        log(f"note: {why}; running on loopback without a shaped link, so transfer time is small")
    tok = tokenizer(model_path)
    items = build("demo", tok, requests, rps, seed=0)
    summaries = {}
    state = None
    dash_pid = None
    runs: dict[str, str] = {}
    stop = {"now": False}

    def on_signal(signum, _frame) -> None:
        stop["now"] = True
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_signal)
    try:
        for method in ("bf16", "hack"):
            log(f"[{method}] starting prefill + decode + router"
                f"{f' over a {link:g} Mbit/s link' if link else ''} ...")
            state = cluster.up(cluster.ClusterSpec(model_path=model_path, kv=method, link_mbps=link,
                                                   label=f"demo-{method}",
                                                   command=" ".join(["hack", *sys.argv[1:]])),
                                log=log)
            runs[method] = state["run_dir"]
            log(f"[{method}] router {state['router_url']}; replaying {requests} requests ...")
            summaries[method] = summarize(replay(state["router_url"], items))
            log(_line(method, summaries[method]))
            if method != "hack":
                cluster.down(state)
                state = None
        log("comparison (same prompts, same link):")
        for m, s in summaries.items():
            log(_line(m, s))
        if dashboard:
            dash_log = Path(runs["hack"]) / "dashboard.log"
            cmd = [sys.executable, "-m", "hack_cli.main", "dashboard", "--run-dir", runs["hack"],
                   "--port", str(port)]
            dash_pid = procs.spawn(cmd, dict(os.environ), dash_log)
            log(f"dashboard: http://127.0.0.1:{port}  (runs {runs['bf16']} and {runs['hack']}; "
                "'Compare two runs' puts them side by side)")
        log(f"HACK router stays up at {state['router_url']}; "
            f"{'stopping in ' + format(duration_s, 'g') + ' s' if duration_s else 'Ctrl-C to stop'}")
        deadline = time.time() + duration_s if duration_s else None
        while not stop["now"] and (deadline is None or time.time() < deadline):
            time.sleep(0.5)
    except KeyboardInterrupt:
        log("stopping ...")
    finally:
        signal.signal(signal.SIGTERM, old)
        if dash_pid:
            procs.stop(dash_pid)
        if state:
            cluster.down(state)
        log("stopped: servers, router, dashboard and links are gone")
    ok = all(s["ok"] == s["requests"] for s in summaries.values()) and len(summaries) == 2
    return 0 if ok else 1

