"""A local disaggregated cluster: prefill server(s), decode server(s) and the PD router.

`up()` starts everything, waits for health and writes a state file (pids, namespace, veth,
URLs) before returning; `down()` stops what a state file names, by pid, and removes the
namespace and veth. `clean_stale()` (run by every `up()`) handles state left by a crash:
processes of dead clusters are stopped and orphaned `hackpd-*` namespaces and `hkv*` veths
are removed.
"""
from __future__ import annotations

import json
import os
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from engine.cpu_runtime import shared_host_env

from . import netns, procs
from .server_cmd import METHODS, router_command, server_command


def state_dir() -> Path:
    d = Path(os.environ.get("HACK_CLUSTER_STATE_DIR",
                            Path.home() / ".cache" / "sglang-hack" / "clusters"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def default_run_root() -> Path:
    return Path(os.environ.get("HACK_RUN_ROOT", Path.home() / ".cache" / "sglang-hack" / "runs"))


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

    def validate(self) -> None:
        if self.kv not in METHODS:
            raise ValueError(f"--kv must be one of {', '.join(METHODS)}, got {self.kv!r}")
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("need at least one prefill and one decode server")
        if self.link_mbps is not None and not self.link_mbps > 0:
            raise ValueError(f"--link-mbps must be positive, got {self.link_mbps}")
        if not Path(self.model_path).exists():
            raise FileNotFoundError(f"model not found: {self.model_path} (run `hack model prepare smollm2`)")


def _get(url: str, timeout: float = 3.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except Exception:  # noqa: BLE001 - any failure means "not healthy yet"
        return 0


def wait_healthy(urls: list[str], pids: list[int], timeout_s: float, logs: list[Path]) -> None:
    deadline = time.time() + timeout_s
    pending = list(urls)
    while pending:
        for pid, log in zip(pids, logs):
            if not procs.alive(pid):
                tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
                raise RuntimeError(f"a server exited during startup (log {log}):\n" + "\n".join(tail))
        pending = [u for u in pending if _get(u) != 200]
        if not pending:
            return
        if time.time() > deadline:
            raise RuntimeError(f"not healthy after {timeout_s:.0f}s: {', '.join(pending)}")
        time.sleep(2.0)


def _server_env(host_ip: str, run_dir: Path, role: str, index: int, spec: ClusterSpec) -> dict:
    env = dict(os.environ)
    env.update({
        "SGLANG_HOST_IP": host_ip,  # the address advertised to mooncake and the bootstrap server
        "SGLANG_USE_CPU_ENGINE": env.get("SGLANG_USE_CPU_ENGINE", "1"),
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(spec.waiting_timeout_s),
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(spec.waiting_timeout_s),
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "3",
        "HACK_DISAGG_WIRE_LOG": str(run_dir / f"wire-{role}-{index}.jsonl"),
        "HACK_METRICS_RUN_DIR": str(run_dir),
        "HACK_METRICS_ROLE": role,
        "HACK_METRICS_INSTANCE": str(index),
    })
    if role == "decode":
        env["HACK_DISAGG_FAULT_FILE"] = str(run_dir / f"fault-trigger-decode-{index}")
    env.pop("SGLANG_IS_IN_CI", None)  # in CI mode SGLang raises on a checksum mismatch
    return shared_host_env(env)


def up(spec: ClusterSpec, log=print) -> dict:
    """Start the cluster; returns its state (also written to the state directory)."""
    spec.validate()
    for line in clean_stale():
        log(f"stale state: {line}")
    name = uuid.uuid4().hex[:6]
    run_dir = Path(spec.run_dir or default_run_root() / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}")
    run_dir.mkdir(parents=True, exist_ok=True)
    state = {"name": name, "run_dir": str(run_dir), "kv": spec.kv, "link_mbps": spec.link_mbps,
             "model_path": spec.model_path, "owner_pid": os.getpid(), "pids": [], "servers": [],
             "link": None, "router_url": None, "started": time.time()}
    state_path = state_dir() / f"{name}.json"

    def save() -> None:
        state_path.write_text(json.dumps(state, indent=1))

    save()
    try:
        link = None
        if spec.link_mbps is not None:
            link = netns.create(name, spec.link_mbps)
            state["link"] = {**link.to_dict(), "namespace": link.namespace, "veth_root": link.veth_root}
            save()
        prefill_ip = link.ns_ip if link else "127.0.0.1"
        decode_ip = link.root_ip if link else "127.0.0.1"
        pids, urls, logs, prefill_eps, decode_urls = [], [], [], [], []
        for role, count, ip in (("prefill", spec.prefill, prefill_ip), ("decode", spec.decode, decode_ip)):
            for i in range(count):
                port = procs.free_port("127.0.0.1")
                bport = procs.free_port("127.0.0.1") if role == "prefill" else None
                cmd = server_command(role, spec.kv, spec.model_path, ip, port, bport,
                                     spec.max_total_tokens, spec.extra_server_args)
                log_path = run_dir / f"{role}-{i}.log"
                pid = procs.spawn(cmd, _server_env(ip, run_dir, role, i, spec), log_path,
                                  netns=link.namespace if (link and role == "prefill") else None)
                url = f"http://{ip}:{port}"
                state["pids"].append(pid)
                state["servers"].append({"role": role, "index": i, "pid": pid, "url": url,
                                         "bootstrap_port": bport, "log": str(log_path)})
                save()
                pids.append(pid)
                urls.append(url + "/health")
                logs.append(log_path)
                (prefill_eps.append((url, bport)) if role == "prefill" else decode_urls.append(url))
        wait_healthy(urls, pids, spec.health_timeout_s, logs)
        rport = procs.free_port()
        rlog = run_dir / "router.log"
        rpid = procs.spawn(router_command(rport, prefill_eps, decode_urls), dict(os.environ), rlog)
        state["pids"].append(rpid)
        state["servers"].append({"role": "router", "index": 0, "pid": rpid,
                                 "url": f"http://127.0.0.1:{rport}", "log": str(rlog)})
        state["router_url"] = f"http://127.0.0.1:{rport}"
        save()
        wait_healthy([state["router_url"] + "/health"], [rpid], spec.health_timeout_s, [rlog])
        state["ready"] = time.time()
        save()
        (run_dir / "cluster.json").write_text(json.dumps(state, indent=1))
        return state
    except BaseException:
        down(state)
        raise


def down(state: dict) -> list[str]:
    """Stop every process of `state` (router first), remove its link and state file."""
    done = []
    for srv in reversed(state.get("servers", [])):
        if procs.stop(int(srv["pid"])):
            done.append(f"stopped {srv['role']}-{srv['index']} (pid {srv['pid']})")
    for pid in state.get("pids", []):
        procs.stop(int(pid))
    link = state.get("link")
    if link:
        done += [f"removed {x}" for x in netns.remove(link.get("namespace"), link.get("veth_root"))]
    (state_dir() / f"{state['name']}.json").unlink(missing_ok=True)
    return done


def load_states() -> list[dict]:
    out = []
    for p in sorted(state_dir().glob("*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            p.unlink(missing_ok=True)
    return out


def clean_stale() -> list[str]:
    """Stop clusters whose launching process is gone and remove orphaned links. Clusters
    started by `hack up` (owner exited normally) stay: they are recorded with owner 'detached'."""
    msgs = []
    live_links = set()
    for st in load_states():
        owner = st.get("owner_pid")
        detached = owner == "detached"
        servers_alive = any(procs.alive(int(s["pid"])) for s in st.get("servers", []))
        if (detached and servers_alive) or (not detached and owner and procs.alive(int(owner))):
            # A link is named after its cluster, and the state is written before the link is
            # created: a cluster still starting up keeps its (future) link.
            live_links.add(f"{netns.NS_PREFIX}{st['name']}")
            continue
        msgs += [f"cluster {st['name']}: {m}" for m in down(st)] or [f"cluster {st['name']}: state removed"]
    if netns.can_shape()[0]:
        # A namespace with processes inside belongs to a running cluster, possibly one recorded
        # in another state directory: only empty, unowned namespaces are orphans.
        for ns in netns.list_namespaces():
            if ns not in live_links and not netns.in_use(ns):
                tag = ns[len(netns.NS_PREFIX):]
                msgs += [f"orphan: removed {x}" for x in netns.remove(ns, f"{netns.VETH_PREFIX}{tag}a")]
        remaining = set(netns.list_namespaces())
        for veth in netns.list_veths():
            tag = veth[len(netns.VETH_PREFIX):-1]
            if f"{netns.NS_PREFIX}{tag}" not in live_links | remaining:
                msgs += [f"orphan: removed {x}" for x in netns.remove(None, veth)]
    return msgs


def detach(state: dict) -> None:
    """Mark a cluster as owned by no process (`hack up` returns while it keeps running)."""
    state["owner_pid"] = "detached"
    (state_dir() / f"{state['name']}.json").write_text(json.dumps(state, indent=1))
