"""docker/compose.yaml and compose.rdma.yaml: the Compose Specification schema, the services,
their GPUs, volumes, health checks and commands (the router's parsed by sglang-router itself).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from docker_parsing import (COMPOSE_FILES, DOCKER, MATRIX, argv, build_mod, compose,
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
    assert flag(dash, "--run-dir") == services["prefill"]["environment"]["HACK_RUN_DIR"]
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
