"""What the schema fuzzer (disagg.schema_fuzz) is run against, and what each target must still be
after it: used by tests/test_fuzz_api.py (bounded, in CI) and `hack bench fuzz` (the long run).

Targets: a colocated HACK server, a colocated BF16 server, and the PD router of a 1P1D HACK
cluster (SGLang's Rust router, `hack up`'s default). After the requests, every server must be
running, answer /health, still generate, and hold no KV memory beyond its radix cache
(engine.usage.is_idle); the router must still count every worker healthy, in its /readiness
and in its own worker list: a router retries 5xx answers and counts them against the worker,
so a client's bad request must never take a healthy server out of rotation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import requests

from engine.usage import is_idle

from .router import ready_workers
from .schema_fuzz import EndpointResult, FuzzRequest, run_requests
from .server_cmd import method_flags

IDLE_TIMEOUT_S = 60.0


class Target(str, Enum):
    HACK = "hack"
    BF16 = "bf16"
    ROUTER = "router"


# The colocated servers: a small fixed KV budget (a valid fuzz case asks for at most 2 tokens).
_COMMON = ["--hack-kv-budget-mb", "128", "--sleep-on-idle", "--random-seed", "0"]
COLOCATED_ARGS: dict[Target, list[str]] = {
    Target.HACK: ["--kv-cache-dtype", "hack", *_COMMON],
    Target.BF16: [*method_flags("bf16"), *_COMMON],
}


def kv_usage(url: str) -> dict | None:
    try:
        info = requests.get(f"{url}/server_info", timeout=30).json()
        return info["internal_states"][0]["hack_kv"]
    except (requests.RequestException, ValueError, KeyError, IndexError, TypeError):
        return None


def still_generates(url: str, timeout: float = 60.0) -> str | None:
    """None when `url` serves a 2-token greedy request, else what went wrong."""
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    try:
        r = requests.post(f"{url}/generate", json=body, timeout=timeout)
    except requests.RequestException as exc:
        return f"no answer to a valid request: {exc!r}"[:300]
    if r.status_code != 200:
        return f"a valid request got {r.status_code}: {r.text[:200]}"
    if r.json().get("meta_info", {}).get("completion_tokens", 0) < 1:
        return "a valid request generated no token"
    return None


def server_problems(name: str, url: str, alive: Callable[[], bool],
                    idle_timeout_s: float = IDLE_TIMEOUT_S, generate_url: str | None = None) -> list[str]:
    """What is wrong with a server after fuzzing: not running, not healthy, not generating
    (through `generate_url`, the router of a PD server; default `url`), KV memory held (waits up
    to `idle_timeout_s` for the pool to settle)."""
    if not alive():
        return [f"{name} is not running any more"]
    out = []
    try:
        health = requests.get(f"{url}/health", timeout=30).status_code
    except requests.RequestException as exc:
        health = repr(exc)[:100]
    if health != 200:
        out.append(f"{name} /health answered {health}")
    deadline = time.monotonic() + idle_timeout_s
    usage = kv_usage(url)
    while not is_idle(usage) and time.monotonic() < deadline:
        time.sleep(0.5)
        usage = kv_usage(url)
    if not is_idle(usage):
        out.append(f"{name}: KV memory not back to idle within {idle_timeout_s:.0f} s: {usage}")
    problem = still_generates(generate_url or url)
    if problem:
        out.append(f"{name}: {problem}")
    return out


def router_workers(router_url: str) -> list[dict] | None:
    """The Rust router's own worker list (url, health, circuit state), None if it gives none."""
    try:
        r = requests.get(f"{router_url}/workers", timeout=10)
        if r.status_code != 200:
            return None
        data = r.json()
    except (requests.RequestException, ValueError):
        return None
    workers = data.get("workers") if isinstance(data, dict) else data
    return workers if isinstance(workers, list) else None


def router_problems(router_url: str, workers: int) -> list[str]:
    """Workers the router no longer counts healthy (its /readiness, and each worker's own
    entry where the router lists them)."""
    out = []
    ready = ready_workers(router_url)
    if ready is not None and ready < workers:
        out.append(f"the router counts {ready} of {workers} workers healthy")
    for w in router_workers(router_url) or []:
        if isinstance(w, dict) and w.get("is_healthy") is False:
            out.append(f"the router marks {w.get('url')} unhealthy")
    return out


@dataclass
class TargetRun:
    target: Target
    endpoints: dict[str, EndpointResult] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # the target's state after the requests

    def failures(self) -> list[str]:
        out = [f"{path}: {f}" for path, res in self.endpoints.items() for f in res.failures]
        out += [f"{path}: the server died after {res.died_after}" for path, res in self.endpoints.items()
                if res.died_after]
        return out + self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target.value, "endpoints": {p: r.to_dict() for p, r in self.endpoints.items()},
                "problems": self.problems,
                "requests": sum(r.sent for r in self.endpoints.values()),
                "server_errors": sum(r.server_errors() for r in self.endpoints.values())}


def fuzz_target(target: Target, base_url: str, reqs: dict[str, list[FuzzRequest]],
                alive: Callable[[], bool], log: Callable[[str], None] = lambda m: None,
                excused: Callable[[FuzzRequest, int], bool] = lambda r, s: False) -> TargetRun:
    """Every endpoint's requests against one target, in order; stops at a death."""
    run = TargetRun(target)
    for path, items in reqs.items():
        res = run_requests(base_url, items, alive, excused=excused)
        run.endpoints[path] = res
        log(f"[{target.value}] {path}: {res.sent} requests in {res.seconds:.0f} s, statuses "
            f"{dict(sorted(res.statuses.items()))}, {len(res.failures)} failing")
        if res.died_after:
            break
    return run
