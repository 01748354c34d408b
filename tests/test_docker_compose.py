"""docker/compose.yaml, compose.rdma.yaml and compose.cpu.yaml: the Compose Specification
schema, the services, their GPUs, volumes, health checks and commands (the router's parsed by
sglang-router itself, the CPU stack's servers by `hack`'s own parser). The CPU stack is also
brought up for real: tests/test_images_e2e.py.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from docker_parsing import (COMPOSE_FILES, DOCKER, MATRIX, argv, build_mod, compose, compose_cpu,
                            compose_schema_validator, flag, interpolate)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_file_matches_the_compose_specification(path: Path) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}"
              for e in compose_schema_validator().iter_errors(yaml.safe_load(path.read_text()))]
    assert not errors, "\n".join(errors)


def test_compose_schema_rejects_a_broken_file() -> None:
    doc = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    doc["services"]["prefill"]["deploy"]["resources"]["reservations"]["devices"][0].pop(
        "capabilities")
    doc["services"]["decode"]["healthcheck"]["intervall"] = "3s"
    paths = {tuple(e.absolute_path) for e in compose_schema_validator().iter_errors(doc)}
    assert ("services", "prefill", "deploy", "resources", "reservations", "devices", 0) in paths
    assert ("services", "decode", "healthcheck") in paths


# ---------------------------------------------------------------- compose
def test_compose_requires_a_model_and_names_no_weights() -> None:
    with pytest.raises(KeyError, match="HACK_MODEL"):
        yaml.safe_load(interpolate((DOCKER / "compose.yaml").read_text(),
                                   {"HACK_MODELS_DIR": "/srv/models"}))
    text = (DOCKER / "compose.yaml").read_text()
    assert not re.search(r"(HF_TOKEN|API_KEY|PASSWORD|SECRET)\s*[:=]", text)


def test_compose_runs_prefill_decode_router_dashboard_on_two_gpus() -> None:
    doc = compose()
    services = doc["services"]
    assert set(services) == {"prefill", "decode", "router", "dashboard"}
    gpus = {}
    for role in ("prefill", "decode"):
        svc = services[role]
        args = argv(svc)
        assert flag(args, "--kv-cache-dtype") == "hack"
        assert flag(args, "--disagg-mode") == role
        assert flag(args, "--disaggregation-transfer-backend") == "mooncake_tcp"
        assert flag(args, "--model-path") == "/models/m"
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        gpus[role] = dev["device_ids"]
        assert "/srv/models:/models:ro" in svc["volumes"]
        assert any(v.startswith("hack-runs:/data/runs") for v in svc["volumes"])
        port = flag(args, "--port")
        assert svc["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/health"
        assert svc["environment"]["HACK_PORT"] == port
        assert svc["image"] == build_mod.image_tag(MATRIX, "sm90")
    assert gpus == {"prefill": ["0"], "decode": ["1"]}
    assert compose({"HACK_PREFILL_GPU": "2"})["services"]["prefill"]["deploy"]["resources"][
        "reservations"]["devices"][0]["device_ids"] == ["2"]
    assert set(doc["volumes"]) == {"hack-runs"}
    for role in ("router", "dashboard"):
        assert services[role]["image"] == build_mod.image_tag(MATRIX, "cpu")
    dash = argv(services["dashboard"])
    assert dash[:2] == ["hack", "dashboard"] and flag(dash, "--port") == "8501"
    # The servers' metrics sinks write where the dashboard reads (the variables engine/metrics
    # reads: a misnamed one leaves the dashboard empty without an error).
    from engine.metrics import http_api

    for role in ("prefill", "decode"):
        env = services[role]["environment"]
        assert flag(dash, "--run-dir") == env["HACK_METRICS_RUN_DIR"]
        assert (env["HACK_METRICS_ROLE"], env["HACK_METRICS_INSTANCE"]) == (role, "0")
    sink_vars = set(re.findall(r"HACK_METRICS_[A-Z_]+", Path(http_api.__file__).read_text()))
    assert {"HACK_METRICS_RUN_DIR", "HACK_METRICS_ROLE", "HACK_METRICS_INSTANCE"} <= sink_vars
    assert services["router"]["depends_on"] == {
        "prefill": {"condition": "service_healthy"}, "decode": {"condition": "service_healthy"}}


def test_router_command_parses_and_points_at_the_servers() -> None:
    import argparse

    from sglang_router.router_args import RouterArgs

    services = compose()["services"]
    args = argv(services["router"])
    assert args[:3] == ["python", "-m", "sglang_router.launch_router"]
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    parsed = RouterArgs.from_cli_args(parser.parse_args(args[3:]), use_router_prefix=False)
    prefill, decode = argv(services["prefill"]), argv(services["decode"])
    assert parsed.pd_disaggregation
    assert parsed.prefill_urls == [(f"http://127.0.0.1:{flag(prefill, '--port')}",
                                    int(flag(prefill, "--disaggregation-bootstrap-port")))]
    assert parsed.decode_urls == [f"http://127.0.0.1:{flag(decode, '--port')}"]
    assert services["router"]["healthcheck"]["test"][-1] == f"http://127.0.0.1:{parsed.port}/health"


def test_transfer_backend_and_extra_args_come_from_the_environment() -> None:
    env = {"HACK_TRANSFER_BACKEND": "mooncake", "HACK_HOST_IP": "10.0.0.5",
           "HACK_PREFILL_ARGS": "--disaggregation-ib-device mlx5_0",
           "HACK_PREFILL_URL": "http://10.0.0.5:30000"}
    services = compose(env)["services"]
    prefill = argv(services["prefill"])
    assert flag(prefill, "--disaggregation-transfer-backend") == "mooncake"
    assert flag(prefill, "--disaggregation-ib-device") == "mlx5_0"
    assert "--disaggregation-ib-device" not in argv(services["decode"])
    assert services["prefill"]["environment"]["SGLANG_HOST_IP"] == "10.0.0.5"
    assert "http://10.0.0.5:30000" in argv(services["router"])
    rdma = yaml.safe_load((DOCKER / "compose.rdma.yaml").read_text())["services"]
    for role in ("prefill", "decode"):
        assert "/dev/infiniband:/dev/infiniband" in rdma[role]["devices"]
        assert rdma[role]["ulimits"]["memlock"] == {"soft": -1, "hard": -1}


# ---------------------------------------------------------------- the CPU stack
def _router_args(service: dict):
    import argparse

    from sglang_router.router_args import RouterArgs

    args = argv(service)
    assert args[:3] == ["python", "-m", "sglang_router.launch_router"]
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return RouterArgs.from_cli_args(parser.parse_args(args[3:]), use_router_prefix=False)


def test_cpu_stack_runs_hack_serve_roles_behind_the_router_on_a_private_network() -> None:
    from hack_cli.main import build_parser

    doc = compose_cpu()
    services = doc["services"]
    assert set(services) == {"prefill", "decode", "router", "dashboard"}
    image = build_mod.image_tag(MATRIX, "cpu")
    parsed = {}
    for role in ("prefill", "decode"):
        svc = services[role]
        assert svc["image"] == image and svc["networks"] == ["hack"] and svc["hostname"] == role
        args = argv(svc)
        assert args[:2] == ["hack", "serve"]
        ns = build_parser().parse_args(args[1:])   # `hack serve` parses it as a user's command line
        assert ns.role.value == role and ns.kv == "hack" and ns.join
        assert ns.advertise_host == "auto" and ns.host == "0.0.0.0"
        assert ns.run_dir == "/data/runs/compose"
        assert "hack-runs:/data/runs" in svc["volumes"]
        assert svc["healthcheck"]["test"][-1] == f"http://127.0.0.1:{ns.port}/health"
        parsed[role] = ns
    router = _router_args(services["router"])
    # The same health checks, retries and breaker cooldown as the router `hack up` starts.
    from disagg.router import router_command

    cmd = router_command(8000, [("http://p:1", 2)], ["http://d:3"])
    ours = _router_args({"command": ["python", *cmd[1:]]})   # argv[0] is this interpreter's path
    for name in ("health_check_interval_secs", "health_failure_threshold", "health_check_timeout_secs",
                 "retry_max_retries", "retry_initial_backoff_ms", "retry_max_backoff_ms",
                 "retry_backoff_multiplier", "cb_timeout_duration_secs", "disable_retries"):
        assert getattr(router, name) == getattr(ours, name), name
    assert router.pd_disaggregation
    assert router.prefill_urls == [(f"http://prefill:{parsed['prefill'].port}", parsed["prefill"].bootstrap_port)]
    assert router.decode_urls == [f"http://decode:{parsed['decode'].port}"]
    assert services["router"]["ports"] == [f"8000:{router.port}"]
    dash = build_parser().parse_args(argv(services["dashboard"])[1:])
    assert dash.runs_root == "/data/runs" and dash.host == "0.0.0.0"
    assert services["dashboard"]["ports"] == [f"8501:{dash.port}"]
    assert "hack-runs:/data/runs:ro" in services["dashboard"]["volumes"]
    assert set(doc["networks"]) == {"hack"} and set(doc["volumes"]) == {"hack-runs"}
    # Only the prefill starts as root, with NET_ADMIN, to shape its link (then drops to hack).
    assert services["prefill"]["user"] == "0:0" and services["prefill"]["cap_add"] == ["NET_ADMIN"]
    for role in ("decode", "router", "dashboard"):
        assert "user" not in services[role] and "cap_add" not in services[role]


def test_cpu_stack_link_kv_and_ports_come_from_the_environment() -> None:
    from hack_cli.main import build_parser

    assert compose_cpu()["services"]["prefill"]["environment"]["HACK_LINK_MBPS"] == "100"
    env = {"HACK_LINK_MBPS": "", "HACK_KV": "bf16", "HACK_ROUTER_PORT": "18000", "HACK_DASHBOARD_PORT": "18501",
           "HACK_PREFILL_ARGS": "--hack-partition-size 32", "HACK_BASE_IMAGE": "localhost/base:1"}
    services = compose_cpu(env)["services"]
    assert services["prefill"]["environment"]["HACK_LINK_MBPS"] == ""   # empty: unshaped
    for role in ("prefill", "decode"):
        assert build_parser().parse_args(argv(services[role])[1:]).kv == "bf16"
    assert argv(services["prefill"])[-2:] == ["--hack-partition-size", "32"]
    assert services["router"]["ports"] == ["18000:8000"] and services["dashboard"]["ports"] == ["18501:8501"]
    assert services["decode"]["build"]["args"]["BASE_IMAGE"] == "localhost/base:1"
