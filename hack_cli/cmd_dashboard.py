"""`hack dashboard [--run-dir DIR | --url URL | --cluster NAME | --synthetic] [--port N]`: the
operator dashboard (a Streamlit app) over a run directory or a live cluster."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hack_metrics.rundir import RUNS_ROOT_HELP

STOP_GRACE_S = 6.0   # Streamlit's own graceful stop can take 15 s; the whole command gets 15


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="live per-request timeline, breakdown and memory "
                                         "dashboard (Streamlit)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--run-dir", help="run directory to show (default: the newest under "
                                       "the runs root)")
    src.add_argument("--url", help="follow a live router or server over HTTP (/hack/events); "
                                    "a router started by `hack up` is followed through the "
                                    "servers its cluster state names")
    src.add_argument("--cluster", help="follow the live cluster of this name (`hack status`)")
    src.add_argument("--synthetic", action="store_true",
                     help="write two labelled synthetic runs (bf16 and hack) and show them")
    p.add_argument("--runs-root", help=f"where run directories live (default: {RUNS_ROOT_HELP})")
    p.add_argument("--port", type=int, default=8501)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--refresh", type=float, default=2.0,
                   help="seconds between refreshes while a run is live (default 2)")
    p.set_defaults(func=run)


def dashboard_env(args: argparse.Namespace) -> tuple[dict, str]:
    """The environment for the app and a line saying what it will show."""
    from hack_metrics import rundir
    from dashboard.sources import HOW_TO_START

    root = Path(args.runs_root) if args.runs_root else rundir.runs_root()
    env = dict(os.environ, HACK_RUNS_DIR=str(root.resolve()),
               HACK_DASHBOARD_REFRESH_S=str(args.refresh))
    env.pop("HACK_DASHBOARD_RUN_DIR", None)
    env.pop("HACK_DASHBOARD_URL", None)
    env.pop("HACK_DASHBOARD_SERVERS", None)
    if getattr(args, "cluster", None):
        from disagg import cluster

        state = cluster.find_state(name=args.cluster)
        if state is None:
            names = ", ".join(s["name"] for s in cluster.load_states()) or "none"
            raise ValueError(f"no cluster named {args.cluster!r} (running: {names}; see "
                             "`hack status`)")
        return _follow_state(env, state, state.get("router_url") or state["servers"][0]["url"])
    if args.url:
        if not args.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
        from disagg import cluster

        state = cluster.find_state(url=args.url)
        if state is not None:
            return _follow_state(env, state, args.url)
        env["HACK_DASHBOARD_URL"] = args.url
        return env, f"following {args.url}"
    if args.synthetic:
        from engine.metrics.synthetic import SyntheticSpec, write_synthetic_run

        write_synthetic_run(SyntheticSpec(kv_mode="bf16", seed=1), root=root)
        run = write_synthetic_run(SyntheticSpec(kv_mode="hack", seed=1), root=root)
        env["HACK_DASHBOARD_RUN_DIR"] = str(run.resolve())
        return env, f"showing synthetic run {run} (compare it with the bf16 one)"
    if args.run_dir:
        run = Path(args.run_dir)
        if not run.is_dir():
            raise FileNotFoundError(f"run directory {run} does not exist")
        env["HACK_DASHBOARD_RUN_DIR"] = str(run.resolve())
        return env, f"showing {run}"
    newest = rundir.newest_run(root)
    if newest is None:
        return env, HOW_TO_START
    return env, f"showing the newest run, {newest}"


def _follow_state(env: dict, state: dict, url: str) -> tuple[dict, str]:
    """Follow a cluster's servers (prefill behind its namespace included): the PD router
    does not list them, the cluster state does."""
    servers = [s["url"] for s in state.get("servers", []) if s.get("role") != "router"]
    env["HACK_DASHBOARD_URL"] = url
    env["HACK_DASHBOARD_SERVERS"] = ",".join(servers)
    return env, f"following cluster {state['name']} at {url} ({', '.join(servers)})"


def streamlit_command(host: str, port: int) -> list[str]:
    import dashboard

    # __path__, not __file__: an editable install may expose the package as a namespace.
    app = Path(next(iter(dashboard.__path__))).resolve() / "app.py"
    return [sys.executable, "-m", "streamlit", "run", str(app),
            "--server.address", host, "--server.port", str(port),
            "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--server.fileWatcherType", "none", "--global.developmentMode", "false",
            "--client.toolbarMode", "minimal", "--theme.base", "light"]


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be 1-65535, got {args.port}")
    env, what = dashboard_env(args)
    print(f"hack dashboard: {what}")
    print(f"hack dashboard: open http://{args.host}:{args.port}", flush=True)
    proc = subprocess.Popen(streamlit_command(args.host, args.port), env=env)

    class Stop(Exception):
        pass

    def on_signal(signum: int, _frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise Stop(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        # poll(), not wait(): a signal arriving inside wait() interrupts it while it holds
        # Popen's wait lock, and waiting again from the handler would deadlock on that lock.
        while proc.poll() is None:
            time.sleep(0.2)
        return proc.returncode
    except Stop as stop:
        signum = stop.args[0]
    # Stop the app we started, then leave at once: os._exit, so that no non-daemon thread
    # keeps `hack dashboard` alive after its app is gone.
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)
