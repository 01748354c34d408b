"""The CPU image built for real and its compose stack run for real (docs/docker.md).

`make images` builds the image (podman here, from a Debian base made with debootstrap: no image
registry is reachable); the stack check (docker/stack_check.py) brings docker/compose.cpu.yaml up
under its own project name and free ports, serves requests through the router over the shaped
prefill link, reads them off the dashboard's page in a headless browser, takes the stack down
and looks for anything left behind. Layer caching keeps a rebuild to the project's own layer
(about a minute); a machine without the cached layers spends ~10 minutes on the first build.
The GPU images' stand-in build is `make images-check` only (docs/docker.md says why).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docker"))
import build_images  # noqa: E402
import stack_check  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.memory_heavy]


@pytest.fixture(scope="module")
def engine() -> build_images.Engine:
    # What `make images` runs first: a container engine (podman from Debian where docker has no
    # engine) and the compose tool.
    subprocess.run(["bash", str(ROOT / "scripts" / "install_containers.sh")], check=True, timeout=1200)
    return build_images.detect_engine()


@pytest.fixture(scope="module")
def cpu_image(engine: build_images.Engine) -> str:
    (record,) = build_images.build(["cpu"], engine, local_base=True, log=print)
    assert record["bytes"] > 0
    return record["tag"]


def _run(engine: build_images.Engine, image: str, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run([engine.value, "run", "--rm", "--network", "none", image, *cmd], capture_output=True,
                          text=True, env=build_images.engine_env(engine), timeout=300)


def test_cpu_image_holds_the_install_and_runs_unprivileged(engine, cpu_image):
    # The transfer engine loads (its system libraries are the install recipe's to provide).
    out = _run(engine, cpu_image, "bash", "-c", "id -u; python --version; hack --help | head -1; "
               "python docker/check_stack.py && python -c 'from mooncake.engine import TransferEngine' "
               "&& echo stack-ok")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "1000" and lines[1].startswith("Python 3.11."), lines
    assert "stack-ok" in lines
    # The health check and the entry point survive the image format (podman's OCI default
    # drops HEALTHCHECK; the build asks for the docker format).
    inspect = subprocess.run([engine.value, "image", "inspect", cpu_image], capture_output=True, text=True,
                             env=build_images.engine_env(engine), timeout=60, check=True)
    meta = json.loads(inspect.stdout)[0]
    config = meta.get("Config") or meta.get("config") or {}
    health = config.get("Healthcheck") or meta.get("Healthcheck") or {}
    assert "HACK_HEALTH_URL" in " ".join(health.get("Test", [])) and health.get("StartPeriod"), health
    assert config.get("Entrypoint") == ["/opt/sglang-hack/docker/entrypoint.sh"]


def test_a_container_that_asks_for_a_shaped_link_without_the_capability_says_so(engine, cpu_image):
    out = subprocess.run([engine.value, "run", "--rm", "--network", "none", "-e", "HACK_LINK_MBPS=100",
                          cpu_image, "true"], capture_output=True, text=True,
                         env=build_images.engine_env(engine), timeout=300)
    assert out.returncode == 1 and "needs the container to start as root with cap NET_ADMIN" in out.stderr


def test_compose_stack_serves_through_the_router_shows_it_and_leaves_nothing(engine, cpu_image, tmp_path):
    result = stack_check.check(engine, requests=3, link_mbps=100.0, out_dir=tmp_path, log=print)
    (tmp_path / "stack.json").write_text(json.dumps(result, indent=1))
    assert "error" not in result, (result.get("error"), (tmp_path / "stack-logs.txt").read_text()[-6000:]
                                   if (tmp_path / "stack-logs.txt").exists() else "")
    assert [r["status"] for r in result["requests"]] == [200, 200, 200]
    assert all(r["text"] and 1 <= r["completion_tokens"] <= 16 for r in result["requests"]), result["requests"]
    assert result["link_shaped"], result["prefill_qdisc"]
    # The page shows what the run recorded, which holds every request served through the router.
    before, after = result["recorded_finished"]
    assert result["served"] <= before <= result["dashboard"]["finished"] <= after, result
    assert result["down_rc"] == 0 and not any(result["leftovers"].values()), result["leftovers"]
    assert result["ok"]
