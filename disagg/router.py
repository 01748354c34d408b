"""The PD router in front of a local cluster: SGLang's production router, or mini-lb on request.

`RouterKind.RUST` runs `sglang_router.launch_router --pd-disaggregation` (the Rust router that
users deploy): it health-checks every worker and takes a dead one out of rotation, retries a
failed request with backoff on another worker, opens a circuit breaker on a worker that keeps
failing, and routes by a policy (cache_aware by default, as upstream). `RouterKind.MINI_LB` is
SGLang's small Python balancer (`--mini-lb`): no health checks, retries or breaker; kept as an
explicit option for comparison and for setups where the Rust binary is unavailable.

The defaults below differ from upstream's where a local cluster needs it, each for a reason:
the health check runs every 2 s instead of 60 s (a killed server must leave rotation in
seconds, not a minute; a dead one refuses the connection, so two checks take it out), its
timeout is 30 s instead of 5 s (SGLang's /health generates one token and answers only when the
scheduler returns something, after up to its own 20 s: on a CPU one forward of a long prompt
takes longer than 5 s, and with the upstream timeout a busy, healthy prefill server was taken
out of rotation mid-soak and every request got a 503), retries wait 1, 2, 4, 8, 8 s instead of
upstream's 50, 75, 112 ms (see `RouterOptions.retry_window_s`), and the router's Prometheus
endpoint gets a free port (upstream's fixed 29000 would collide when two clusters run on one
machine).

Why the retries must outlast detection: until the health checker takes a dead server out of
rotation, the policy may pick it again for every retry (a dead server holds no load, so the
load-aware policies favour it, and cache_aware keeps a prefix on the server that cached it).
Upstream's three quick retries all landed on a killed prefill in CI and the client got a 502
while a healthy prefill was idle. A retry window longer than the detection time lets the
retries after detection reach a live server. Detection is not fast here: one round of health
checks waits for the slowest /health, and SGLang's /health takes at least a second (it waits
for the scheduler to answer a one-token generation), several under load: measured 1.5 to
9.3 s for a killed prefill with a 2 s interval.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")

# How long one round of health checks may take beyond its interval: SGLang's /health answers
# after >= 1 s (a one-token generation), several seconds under load, and a round waits for the
# slowest server (measured: a killed prefill left rotation 9.3 s after the kill with a 2 s
# interval on a loaded 2-core host).
HEALTH_ROUND_ALLOWANCE_S = 5.0


class RouterKind(str, Enum):
    RUST = "rust"
    MINI_LB = "mini-lb"


@dataclass(frozen=True)
class RouterOptions:
    """What `hack up` passes to the router. Policies and thresholds apply to the Rust router;
    mini-lb takes none of them (asking for one with mini-lb is refused by `validate`)."""
    kind: RouterKind = RouterKind.RUST
    policy: str | None = None  # both roles; None: upstream's default (cache_aware)
    prefill_policy: str | None = None
    decode_policy: str | None = None
    health_check_interval_s: int = 2
    health_failure_threshold: int = 2
    health_check_timeout_s: int = 30  # above SGLang's own 20 s health-generation timeout
    retries: int = 5  # after the first attempt
    retry_backoff_ms: int = 1000  # the first wait; doubles up to retry_max_backoff_ms
    retry_max_backoff_ms: int = 8000
    request_timeout_s: int = 1800
    # How long an open circuit breaker keeps a worker out before trying it again. Upstream's 60 s
    # kept a prefill out for 64 s after a 60 s partition of its link had healed (every request
    # meanwhile: 503 "all circuits open or unhealthy"); the health checks already keep a dead
    # server out, so the breaker's cooldown need only be a few health rounds.
    breaker_cooldown_s: int = 5
    extra: tuple[str, ...] = field(default_factory=tuple)  # more launch_router flags, verbatim

    def validate(self) -> None:
        for name in ("policy", "prefill_policy", "decode_policy"):
            value = getattr(self, name)
            if value is not None and value not in POLICIES:
                raise ValueError(f"--router-{name.replace('_', '-')} must be one of "
                                 f"{', '.join(POLICIES)}, got {value!r}")
        if self.kind is RouterKind.MINI_LB:
            asked = [n for n in ("policy", "prefill_policy", "decode_policy") if getattr(self, n)]
            if asked or self.extra:
                what = ", ".join([f"--router-{n.replace('_', '-')}" for n in asked]
                                 + (["--router-arg"] if self.extra else []))
                raise ValueError(f"{what}: mini-lb takes no routing options; they are flags of "
                                 "the Rust router (--router rust, the default)")
        if min(self.health_check_interval_s, self.health_failure_threshold, self.health_check_timeout_s) < 1:
            raise ValueError("router health checks need an interval, a timeout and a failure threshold >= 1")
        if self.breaker_cooldown_s < 1:
            raise ValueError(f"the router's circuit-breaker cooldown must be >= 1 s, got {self.breaker_cooldown_s}")
        if self.retries < 0:
            raise ValueError(f"router retries must be >= 0, got {self.retries}")
        if not 0 < self.retry_backoff_ms <= self.retry_max_backoff_ms:
            raise ValueError("router retry backoff must be > 0 ms and at most the largest backoff "
                             f"({self.retry_max_backoff_ms} ms), got {self.retry_backoff_ms}")

    def retry_window_s(self) -> float:
        """How long the router keeps retrying a request that keeps failing: the sum of its
        waits (upstream adds up to 20% jitter on top, and each attempt's own time)."""
        waits = [min(self.retry_backoff_ms * 2 ** i, self.retry_max_backoff_ms)
                 for i in range(self.retries)]
        return sum(waits) / 1000

    def detection_time_s(self) -> float:
        """A bound on how long a killed server stays in rotation: `health_failure_threshold`
        failed rounds of health checks, each its interval plus the slowest /health."""
        return self.health_failure_threshold * (self.health_check_interval_s + HEALTH_ROUND_ALLOWANCE_S)

    def warnings(self) -> list[str]:
        """Sentences for the operator about settings that lose requests a dead server takes."""
        if self.kind is RouterKind.MINI_LB:
            return ["mini-lb has no health checks or retries: requests sent to a dead server fail "
                    "until the cluster is restarted"]
        if self.retry_window_s() < self.detection_time_s():
            return [f"router retries span {self.retry_window_s():.0f} s, less than the "
                    f"{self.detection_time_s():.0f} s a dead server can stay in rotation: requests "
                    "routed to it in between can fail (raise --router-retries or "
                    "--router-retry-backoff-ms, or lower --router-health-interval)"]
        return []


def router_command(port: int, prefill: list[tuple[str, int | None]], decode: list[str],
                   options: RouterOptions | None = None, prometheus_port: int | None = None) -> list[str]:
    """The command line of the PD router on 127.0.0.1:`port` in front of `prefill` (URL,
    bootstrap port) and `decode` (URL) servers."""
    opts = options or RouterOptions()
    opts.validate()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
           "--host", "127.0.0.1", "--port", str(port)]
    for url, bport in prefill:
        cmd += ["--prefill", url] + ([str(bport)] if bport is not None else [])
    for url in decode:
        cmd += ["--decode", url]
    if opts.kind is RouterKind.MINI_LB:
        return cmd + ["--mini-lb"]
    for flag, value in (("--policy", opts.policy), ("--prefill-policy", opts.prefill_policy),
                        ("--decode-policy", opts.decode_policy)):
        if value is not None:
            cmd += [flag, value]
    # Workers are registered asynchronously after the router starts, each once its health
    # check passes (upstream checks every 30 s): 1 s here, and `wait_ready` waits for all.
    cmd += ["--worker-startup-check-interval", "1",
            "--health-check-interval-secs", str(opts.health_check_interval_s),
            "--health-failure-threshold", str(opts.health_failure_threshold),
            "--health-check-timeout-secs", str(opts.health_check_timeout_s),
            "--request-timeout-secs", str(opts.request_timeout_s),
            "--cb-timeout-duration-secs", str(opts.breaker_cooldown_s)]
    if opts.retries:  # upstream counts the first attempt among its "max retries"
        cmd += ["--retry-max-retries", str(opts.retries + 1),
                "--retry-initial-backoff-ms", str(opts.retry_backoff_ms),
                "--retry-max-backoff-ms", str(opts.retry_max_backoff_ms),
                "--retry-backoff-multiplier", "2"]
    else:
        cmd += ["--disable-retries"]
    if prometheus_port is not None:
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port)]
    return cmd + list(opts.extra)


def ready_workers(router_url: str, timeout: float = 3.0) -> int | None:
    """How many workers the Rust router counts healthy (its /readiness); None when the router
    does not say (mini-lb has no such endpoint, it knows its workers from the command line)."""
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(router_url + "/readiness", timeout=timeout) as r:
            return int(json.loads(r.read() or b"{}").get("healthy_workers", 0))
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        try:  # 503 while not ready, with the same counts
            return int(json.loads(exc.read() or b"{}").get("healthy_workers", 0))
        except (ValueError, AttributeError):
            return 0
    except Exception:  # noqa: BLE001 - not answering yet
        return 0


def wait_ready(router_url: str, workers: int, timeout_s: float, alive: Callable[[], bool]) -> None:
    """Until the router routes to all `workers` (a request sent before would get a 503: the
    router's own /health answers before it has registered any worker)."""
    import time

    deadline = time.time() + timeout_s
    while True:
        n = ready_workers(router_url)
        if n is None or n >= workers:
            return
        if not alive():
            raise RuntimeError("the router exited while registering its workers")
        if time.time() > deadline:
            raise RuntimeError(f"the router counts {n} of {workers} workers healthy after {timeout_s:.0f}s")
        time.sleep(0.5)
