"""A local disaggregated cluster: prefill server(s), decode server(s) and the PD router.

`up()` starts everything, waits for health and writes a state file (pids, namespace, veth,
URLs) before returning, and a run directory under the runs root ($HACK_RUNS_DIR) whose
run.json names the method, model, link, servers and command line before any request;
`down()` stops what a state file names, by pid, removes the namespace and veth and marks the
run finished; `status()` says what a state file's processes are doing. `clean_stale()` (run by every `up()`) handles state left by a crash:
processes of dead clusters are stopped and orphaned `hackpd-*` namespaces and `hkv*` veths
are removed.
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from engine.cpu_runtime import shared_host_env
from engine.launcher import free_port
from hack_metrics import rundir

from . import netns, procs
from .router import RouterOptions, router_command, wait_ready
from .server_cmd import METHODS, STATIC_PREFIX, is_method, server_command


def state_dir() -> Path:
    d = Path(os.environ.get("HACK_CLUSTER_STATE_DIR",
                            Path.home() / ".cache" / "sglang-hack" / "clusters"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def default_run_root() -> Path:
    """The one runs root of every command (hack_metrics.rundir.runs_root)."""
    return rundir.runs_root()


def link_rate_label(link_mbps: float | None) -> str | None:
    return None if link_mbps is None else f"{link_mbps:g}mbit"


@dataclass
class ClusterSpec:
    model_path: str
    kv: str = "hack"
    link_mbps: float | None = None
    prefill: int = 1
    decode: int = 1
    max_total_tokens: int = 32768
    run_dir: Path | None = None
    health_timeout_s: float = 600.0
    extra_server_args: list[str] = field(default_factory=list)
    # Seconds a decode waits for a silent prefill before failing the request.
    waiting_timeout_s: int = 300
    model: str | None = None  # the model's name as given (default: its folder's name)
    label: str | None = None  # run directory label (default: "<kv>-<rate>mbit")
    command: str | None = None  # the command line that started it, kept in run.json
    enable_metrics: bool = False  # SGLang's /metrics, with the hack:* metrics beside sglang:*
    router: RouterOptions = field(default_factory=RouterOptions)
    # the prefill servers' page tier (--hack-page-tier): one directory they all share (a record's
    # key is its token prefix, so a prefix one prefill wrote another restores); None: off
    page_tier: str | None = None

    def validate(self) -> None:
        if not is_method(self.kv):
            raise ValueError(f"--kv must be one of {', '.join(METHODS)}, {STATIC_PREFIX}FRACTION, got {self.kv!r}")
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("need at least one prefill and one decode server")
        if self.link_mbps is not None and not self.link_mbps > 0:
            raise ValueError(f"--link-mbps must be positive, got {self.link_mbps}")
        if not Path(self.model_path).exists():
            raise FileNotFoundError(f"model not found: {self.model_path} (run `hack model prepare smollm2`)")
        self.router.validate()


def link_tag(cluster: str, prefill_index: int) -> str:
    """The link tag of prefill `prefill_index` (the first keeps the cluster's name; a veth name
    has at most 15 characters: 'hkv' + tag + 'a')."""
    return cluster if prefill_index == 0 else f"{cluster}p{prefill_index}"


def state_links(state: dict) -> list[dict]:
    """Every shaped link a cluster state names (one per prefill; older states hold one)."""
    links = state.get("links")
    if links is None:
        links = [state["link"]] if state.get("link") else []
    return [link for link in links if link]


def _get(url: str, timeout: float = 3.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except Exception:  # noqa: BLE001 - any failure means "not healthy yet"
        return 0


BIND_FAILED = "error while attempting to bind on address"


def wait_healthy(urls: list[str], pids: list[int], timeout_s: float, logs: list[Path]) -> None:
    deadline = time.time() + timeout_s
    pending = list(urls)
    while pending:
        for pid, log in zip(pids, logs):
            text = log.read_text(errors="replace") if log.exists() else ""
            if not procs.alive(pid):
                raise RuntimeError(f"a server exited during startup (log {log}):\n"
                                   + "\n".join(text.splitlines()[-15:]))
            if BIND_FAILED in text:
                # SGLang's HTTP server gives up on the port but the process stays up: it would
                # never answer, so waiting out the timeout only hides the cause.
                line = next(ln for ln in text.splitlines() if BIND_FAILED in ln)
                raise RuntimeError(f"a server could not listen on its port (log {log}): {line.strip()}")
        pending = [u for u in pending if _get(u) != 200]
        if not pending:
            return
        if time.time() > deadline:
            raise RuntimeError(f"not healthy after {timeout_s:.0f}s: {', '.join(pending)}")
        time.sleep(0.5)


def server_env(host_ip: str, run_dir: Path, role: str, index: int, *, waiting_timeout_s: int = 300,
               enable_metrics: bool = False, base: dict | None = None) -> dict:
    """The environment of one prefill or decode server (`base`: this process's by default);
    also what `hack serve --role` gives the server of a container."""
    env = dict(os.environ if base is None else base)
    env.update({
        "SGLANG_HOST_IP": host_ip,  # the address advertised to mooncake and the bootstrap server
        "SGLANG_USE_CPU_ENGINE": env.get("SGLANG_USE_CPU_ENGINE", "1"),
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(waiting_timeout_s),
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(waiting_timeout_s),
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "3",
        "HACK_DISAGG_WIRE_LOG": str(Path(run_dir) / f"wire-{role}-{index}.jsonl"),
        "HACK_METRICS_RUN_DIR": str(run_dir),
        "HACK_METRICS_ROLE": role,
        "HACK_METRICS_INSTANCE": str(index),
        "HACK_METRICS_PROMETHEUS": "1" if enable_metrics else "0",
    })
    if role == "decode":
        env["HACK_DISAGG_FAULT_FILE"] = str(Path(run_dir) / f"fault-trigger-decode-{index}")
    env.pop("SGLANG_IS_IN_CI", None)  # in CI mode SGLang raises on a checksum mismatch
    return shared_host_env(env)


def up(spec: ClusterSpec, log=print) -> dict:
    """Start the cluster; returns its state (also written to the state directory)."""
    spec.validate()
    for line in clean_stale():
        log(f"stale state: {line}")
    name = uuid.uuid4().hex[:6]
    rate = link_rate_label(spec.link_mbps)
    label = spec.label or f"{spec.kv}-{rate or 'loopback'}"
    extra = {"cluster": name, "model": spec.model or Path(spec.model_path).name, "model_path": spec.model_path,
             "link_mbps": spec.link_mbps, "command": spec.command,
             "prefill": spec.prefill, "decode": spec.decode}
    if spec.run_dir:
        run_dir = rundir.init_run(spec.run_dir, label, spec.kv, link_rate=rate, extra=extra)
    else:
        run_dir = rundir.create_run(label, spec.kv, link_rate=rate, extra=extra)
    state = {"name": name, "run_dir": str(run_dir), "kv": spec.kv, "link_mbps": spec.link_mbps,
             "model_path": spec.model_path, "owner_pid": os.getpid(), "pids": [], "servers": [],
             "link": None, "router_url": None, "started": time.time(),
             "command": spec.command, "enable_metrics": spec.enable_metrics, "page_tier": spec.page_tier}
    state_path = state_dir() / f"{name}.json"

    def save() -> None:
        state_path.write_text(json.dumps(state, indent=1))

    save()
    try:
        # One shaped link per prefill server (its own namespace and veth, tagged after the
        # cluster), so each prefill's KV crosses its own link of the given rate, as on separate
        # machines. Decode servers live in the root namespace, reachable from every link.
        links: list[netns.ShapedLink] = []
        if spec.link_mbps is not None:
            state["links"] = []
            for i in range(spec.prefill):
                link = netns.create(link_tag(name, i), spec.link_mbps)
                links.append(link)
                state["links"].append({**link.to_dict(), "namespace": link.namespace,
                                       "veth_root": link.veth_root})
                state["link"] = state["links"][0]  # the first prefill's (single-prefill tools)
                save()
        pids, urls, logs, prefill_eps, decode_urls = [], [], [], [], []
        for role, count in (("prefill", spec.prefill), ("decode", spec.decode)):
            for i in range(count):
                if not links:
                    ip = "127.0.0.1"
                else:  # a decode server listens on the first link's root address (any works)
                    ip = links[i].ns_ip if role == "prefill" else links[0].root_ip
                port = free_port("127.0.0.1")
                bport = free_port("127.0.0.1") if role == "prefill" else None
                extra_args = list(spec.extra_server_args)
                if spec.page_tier and role == "prefill":
                    extra_args += ["--hack-page-tier", str(Path(spec.page_tier).resolve())]
                if spec.enable_metrics and "--enable-metrics" not in extra_args:
                    extra_args.append("--enable-metrics")
                cmd = server_command(role, spec.kv, spec.model_path, ip, port, bport,
                                     spec.max_total_tokens, extra_args)
                log_path = run_dir / f"{role}-{i}.log"
                ns = links[i].namespace if (links and role == "prefill") else None
                env = server_env(ip, run_dir, role, i, waiting_timeout_s=spec.waiting_timeout_s,
                                 enable_metrics=spec.enable_metrics)
                pid = procs.spawn(cmd, env, log_path, netns=ns)
                url = f"http://{ip}:{port}"
                state["pids"].append(pid)
                state["servers"].append({"role": role, "index": i, "pid": pid, "url": url,
                                         "bootstrap_port": bport, "log": str(log_path),
                                         **({"namespace": ns} if ns else {})})
                save()
                rundir.register_server(run_dir, f"{role}-{i}", role, url, pid=pid)
                pids.append(pid)
                urls.append(url + "/health")
                logs.append(log_path)
                (prefill_eps.append((url, bport)) if role == "prefill" else decode_urls.append(url))
        wait_healthy(urls, pids, spec.health_timeout_s, logs)
        rport = free_port()
        rlog = run_dir / "router.log"
        rcmd = router_command(rport, prefill_eps, decode_urls, spec.router, prometheus_port=free_port())
        rpid = procs.spawn(rcmd, dict(os.environ), rlog)
        state["pids"].append(rpid)
        state["servers"].append({"role": "router", "index": 0, "pid": rpid,
                                 "url": f"http://127.0.0.1:{rport}", "log": str(rlog),
                                 "kind": spec.router.kind.value})
        state["router"] = spec.router.kind.value
        state["router_url"] = f"http://127.0.0.1:{rport}"
        save()
        rundir.update_run(run_dir, router=state["router_url"])
        wait_healthy([state["router_url"] + "/health"], [rpid], spec.health_timeout_s, [rlog])
        wait_ready(state["router_url"], spec.prefill + spec.decode, spec.health_timeout_s,
                   lambda: procs.alive(rpid))
        state["ready"] = time.time()
        save()
        (run_dir / "cluster.json").write_text(json.dumps(state, indent=1))
        return state
    except BaseException:
        down(state)
        raise


def down(state: dict) -> list[str]:
    """Stop every process of `state` at once, remove its link and state file, mark its run
    finished."""
    servers = list(reversed(state.get("servers", [])))
    running = set(procs.stop_all([int(s["pid"]) for s in servers] +
                                 [int(p) for p in state.get("pids", [])]))
    done = [f"stopped {s['role']}-{s['index']} (pid {s['pid']})" for s in servers
            if int(s["pid"]) in running]
    for link in state_links(state):
        done += [f"removed {x}" for x in netns.remove(link.get("namespace"), link.get("veth_root"))]
    run_dir = state.get("run_dir")
    if run_dir and (Path(run_dir) / rundir.RUN_JSON).exists():
        try:
            if not rundir.read_run(run_dir).get("finished"):
                rundir.mark_finished(run_dir)
        except (OSError, ValueError) as exc:
            done.append(f"run.json of {run_dir} not marked finished: {exc}")
    (state_dir() / f"{state['name']}.json").unlink(missing_ok=True)
    return done


def _health(url: str, timeout: float = 5.0) -> str:
    """'ok', 'HTTP <code>' or 'unreachable' for a server's /health."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return "ok" if r.status == 200 else f"HTTP {r.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except Exception:  # noqa: BLE001 - refused, timed out, no route: not answering
        return "unreachable"


def status(state: dict) -> dict:
    """What a cluster's state file names and what is true now: each server's pid alive and
    /health answer. `stale` when no process of it is alive (a crash, a reboot, a kill -9):
    `hack down` (or the next `hack up`) removes such state."""
    servers, problems = [], []
    for s in state.get("servers", []):
        alive = procs.alive(int(s["pid"]))
        health = _health(s["url"]) if alive else "process gone"
        servers.append({"role": s["role"], "index": s["index"], "url": s["url"], "pid": s["pid"],
                        "alive": alive, "health": health})
        if health != "ok":
            problems.append(f"{s['role']}-{s['index']} (pid {s['pid']}): {health}")
    owner = state.get("owner_pid")
    starting = owner != "detached" and owner and procs.alive(int(owner)) and "ready" not in state
    stale = not any(s["alive"] for s in servers) and not starting
    namespaces = [link.get("namespace") for link in state_links(state) if link.get("namespace")]
    if namespaces and netns.can_shape()[0]:
        present = set(netns.list_namespaces())
        problems += [f"network namespace {ns} is gone" for ns in namespaces if ns not in present]
    ns = namespaces[0] if namespaces else None
    return {"name": state["name"], "kv": state.get("kv"), "link_mbps": state.get("link_mbps"),
            "model_path": state.get("model_path"), "run_dir": state.get("run_dir"),
            "router_url": state.get("router_url"), "started": state.get("started"),
            "ready": state.get("ready"), "namespace": ns, "namespaces": namespaces,
            "router": state.get("router"), "command": state.get("command"),
            "owner": owner, "state": "stale" if stale else "starting" if starting
            else "degraded" if problems else "running",
            "problems": problems, "servers": servers}


def find_state(name: str | None = None, url: str | None = None) -> dict | None:
    """The cluster named `name`, or the one whose router or a server has `url`."""
    want = url.rstrip("/") if url else None
    for st in load_states():
        if name is not None and st.get("name") == name:
            return st
        urls = [st.get("router_url")] + [s.get("url") for s in st.get("servers", [])]
        if want is not None and want in [u.rstrip("/") for u in urls if u]:
            return st
    return None


def load_states() -> list[dict]:
    out = []
    for p in sorted(state_dir().glob("*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            p.unlink(missing_ok=True)
    return out


ORPHAN_MIN_AGE_S = 600.0


def clean_stale() -> list[str]:
    """Stop clusters whose launching process is gone and remove orphaned links. Clusters
    started by `hack up` (owner exited normally) stay: they are recorded with owner 'detached'."""
    msgs = []
    live_prefixes: set[str] = set()

    def live(ns: str) -> bool:
        return any(ns.startswith(p) for p in live_prefixes)

    for st in load_states():
        owner = st.get("owner_pid")
        detached = owner == "detached"
        servers_alive = any(procs.alive(int(s["pid"])) for s in st.get("servers", []))
        if (detached and servers_alive) or (not detached and owner and procs.alive(int(owner))):
            # Links are named after their cluster, and the state is written before a link is
            # created: a cluster still starting up keeps its (future) links.
            live_prefixes.add(f"{netns.NS_PREFIX}{st['name']}")
            continue
        msgs += [f"cluster {st['name']}: {m}" for m in down(st)] or [f"cluster {st['name']}: state removed"]
    if netns.can_shape()[0]:
        # A namespace with processes inside belongs to a running cluster, possibly one recorded
        # in another state directory, and so may a young one (a cluster of another state
        # directory between creating its link and starting its prefill in it): only empty,
        # unowned namespaces older than ORPHAN_MIN_AGE_S are orphans.
        for ns in netns.list_namespaces():
            age = netns.age_s(ns)
            if not live(ns) and not netns.in_use(ns) and (age is None or age >= ORPHAN_MIN_AGE_S):
                tag = ns[len(netns.NS_PREFIX):]
                msgs += [f"orphan: removed {x}" for x in netns.remove(ns, f"{netns.VETH_PREFIX}{tag}a")]
        remaining = set(netns.list_namespaces())
        for veth in netns.list_veths():
            ns = f"{netns.NS_PREFIX}{veth[len(netns.VETH_PREFIX):-1]}"
            if not live(ns) and ns not in remaining:
                msgs += [f"orphan: removed {x}" for x in netns.remove(None, veth)]
    return msgs


def detach(state: dict) -> None:
    """Mark a cluster as owned by no process (`hack up` returns while it keeps running)."""
    state["owner_pid"] = "detached"
    (state_dir() / f"{state['name']}.json").write_text(json.dumps(state, indent=1))
