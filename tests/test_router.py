"""The PD router command `hack up` starts (disagg/router.py), checked by SGLang's own router
argument parser, and the per-prefill links of a cluster state, without starting anything."""
from __future__ import annotations

import argparse

import pytest

from disagg import cluster
from disagg.router import RouterKind, RouterOptions, router_command

PREFILL = [("http://10.211.10.2:30000", 8998), ("http://10.211.11.2:30002", 8999)]
DECODE = ["http://10.211.10.1:30001", "http://10.211.10.1:30003"]


def _parse(cmd: list[str]):
    from sglang_router.router_args import RouterArgs

    assert cmd[1:3] == ["-m", "sglang_router.launch_router"]
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return RouterArgs.from_cli_args(parser.parse_args(cmd[3:]), use_router_prefix=False)


def test_rust_router_is_the_default_with_health_checks_retries_and_breaker() -> None:
    parsed = _parse(router_command(8000, PREFILL, DECODE, prometheus_port=29123))
    assert parsed.pd_disaggregation and not parsed.mini_lb
    assert parsed.prefill_urls == PREFILL and parsed.decode_urls == DECODE
    assert parsed.health_check_interval_secs == 2 and parsed.health_failure_threshold == 2
    assert parsed.health_check_timeout_secs == 30  # above SGLang's 20 s health generation
    # five retries after the first attempt (upstream counts the attempt), waits 1, 2, 4, 8, 8 s
    assert parsed.retry_max_retries == 6 and not parsed.disable_retries
    assert parsed.retry_initial_backoff_ms == 1000 and parsed.retry_max_backoff_ms == 8000
    assert parsed.retry_backoff_multiplier == 2
    assert not parsed.disable_circuit_breaker and not parsed.disable_health_check
    assert parsed.cb_timeout_duration_secs == 5   # a healed worker back within seconds, not upstream's 60
    assert parsed.prometheus_port == 29123 and parsed.host == "127.0.0.1" and parsed.port == 8000
    assert parsed.policy == "cache_aware"  # upstream's default when none is asked for


def test_policies_thresholds_and_extra_flags_pass_through() -> None:
    opts = RouterOptions(policy="round_robin", decode_policy="power_of_two", retries=0,
                         health_check_interval_s=5, extra=("--cb-failure-threshold", "4"))
    parsed = _parse(router_command(8000, PREFILL[:1], DECODE[:1], opts))
    assert parsed.policy == "round_robin" and parsed.decode_policy == "power_of_two"
    assert parsed.prefill_policy is None
    assert parsed.disable_retries and parsed.health_check_interval_secs == 5
    assert parsed.cb_failure_threshold == 4


def test_mini_lb_only_when_asked_and_without_routing_options() -> None:
    parsed = _parse(router_command(8000, PREFILL, DECODE, RouterOptions(kind=RouterKind.MINI_LB)))
    assert parsed.mini_lb and parsed.prefill_urls == PREFILL
    with pytest.raises(ValueError, match="mini-lb takes no routing options"):
        RouterOptions(kind=RouterKind.MINI_LB, policy="random").validate()
    with pytest.raises(ValueError, match="--router-policy must be one of"):
        RouterOptions(policy="fastest").validate()
    with pytest.raises(ValueError, match="retries"):
        RouterOptions(retries=-1).validate()
    with pytest.raises(ValueError, match="backoff"):
        RouterOptions(retry_backoff_ms=0).validate()


def test_retries_outlast_the_time_a_dead_server_stays_in_rotation() -> None:
    opts = RouterOptions()
    assert opts.retry_window_s() == pytest.approx(1 + 2 + 4 + 8 + 8)
    # 2 failed rounds of (2 s interval + 5 s for the slowest /health): 14 s < 23 s
    assert opts.detection_time_s() == pytest.approx(14.0)
    assert opts.warnings() == []
    # upstream's schedule (3 attempts, 50 ms doubling) is over in 0.15 s: the operator is told
    quick = RouterOptions(retries=2, retry_backoff_ms=50)
    assert quick.retry_window_s() == pytest.approx(0.15)
    assert "less than the 14 s a dead server can stay in rotation" in quick.warnings()[0]
    assert "no health checks" in RouterOptions(kind=RouterKind.MINI_LB).warnings()[0]


def test_hack_up_flags_build_the_options_and_refuse_bad_combinations() -> None:
    from hack_cli.cmd_cluster import router_options_from_args
    from hack_cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["up", "--router-policy", "random", "--router-retries", "1",
                              "--router-retry-backoff-ms", "20000",
                              "--router-arg=--cb-failure-threshold=4"])
    opts = router_options_from_args(args)
    assert opts.kind is RouterKind.RUST and opts.policy == "random" and opts.retries == 1
    assert opts.retry_backoff_ms == 20000 and opts.retry_max_backoff_ms == 20000
    assert opts.extra == ("--cb-failure-threshold=4",)
    args = parser.parse_args(["up", "--router", "mini-lb", "--router-policy", "random"])
    with pytest.raises(ValueError, match="mini-lb takes no routing options"):
        router_options_from_args(args)
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--router", "nginx"])


def test_each_prefill_gets_its_own_link_tag_within_the_veth_name_limit() -> None:
    tags = [cluster.link_tag("a1b2c3", i) for i in range(4)]
    assert tags[0] == "a1b2c3" and len(set(tags)) == 4
    assert all(len(f"hkv{t}a") <= 15 for t in tags)  # Linux interface names: 15 characters


def test_state_links_reads_new_and_old_states() -> None:
    one = {"namespace": "hackpd-abc", "veth_root": "hkvabca"}
    two = {"namespace": "hackpd-abcp1", "veth_root": "hkvabcp1a"}
    assert cluster.state_links({"links": [one, two], "link": one}) == [one, two]
    assert cluster.state_links({"link": one}) == [one]  # written before one link per prefill
    assert cluster.state_links({"link": None}) == []


def test_wait_ready_waits_for_every_worker_and_knows_mini_lb_has_no_readiness() -> None:
    import http.server
    import json
    import threading

    from disagg.router import ready_workers, wait_ready

    counts = iter([0, 1, 2, 3, 3, 3, 3, 3, 3, 3])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the Rust router: 503 with the counts until all are healthy
            if self.path != "/readiness":
                self.send_response(404)
                self.end_headers()
                return
            n = next(counts)
            body = json.dumps({"status": "ready" if n == 3 else "not ready", "healthy_workers": n,
                               "total_workers": 3}).encode()
            self.send_response(200 if n == 3 else 503)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_port}"
    try:
        wait_ready(url, 3, timeout_s=30, alive=lambda: True)
        assert ready_workers(url) == 3
        with pytest.raises(RuntimeError, match="the router exited"):
            counts = iter([1] * 10)
            wait_ready(url, 3, timeout_s=30, alive=lambda: False)
    finally:
        srv.shutdown()
    assert ready_workers("http://127.0.0.1:9") == 0  # nothing listening: not ready yet
