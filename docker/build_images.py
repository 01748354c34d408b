"""Build the images of docker/matrix.yaml (or print the commands).

    python docker/build_images.py --print            # every supported GPU family and the CPU image
    python docker/build_images.py h100 cpu           # build two of them (docker, or podman if no docker)
    python docker/build_images.py cpu --local-base   # no registry: the base from Debian's archive
    python docker/build_images.py h100 --stand-in-base   # no GPU registry: see docs/docker.md

Run from anywhere; the build context is the repository root. Asking for a family the matrix
marks unsupported (T4, V100) stops with the reason instead of building a broken image.

The engine is docker when a Docker engine answers, else podman (`--engine` picks one). With
podman the build uses the docker image format (HEALTHCHECK and SHELL are kept), the
Dockerfile's own context filter (`--ignorefile`) and the project's containers.conf
(docker/podman/containers.conf). A CA bundle the host's pip trusts (PIP_CERT, or pip's `cert`
setting) is passed as the build secret pip_ca, for a registry reached through a TLS-inspecting
proxy; it never lands in a layer.

`--local-base` builds the CPU image on a Debian 12 + Python 3.11 base made with debootstrap
(docker/base/debian_base.sh) instead of python:3.11-slim-bookworm. `--stand-in-base` builds a
GPU family's image on that same base instead of NVIDIA's CUDA image: every step but the CUDA
runtime (the pinned CUDA wheels resolve and install, check_stack passes, the user and entry
point are set); what only NVIDIA's base and a GPU prove is listed in docs/docker.md. The
stand-in image is tagged `...-sm90-standin`, never the real tag.
"""
from __future__ import annotations

import argparse
import enum
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_stack import load_matrix  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
PODMAN_CONF = DOCKER / "podman" / "containers.conf"
LOCAL_BASE_TAG = "localhost/sglang-hack-base:bookworm-py3.11"
STAND_IN_SUFFIX = "-standin"


class Engine(str, enum.Enum):
    DOCKER = "docker"
    PODMAN = "podman"


def image_tag(matrix: dict[str, Any], suffix: str) -> str:
    """`sglang-hack:<version>-<suffix>`, the tag compose.yaml refers to."""
    return f"{matrix['image']}:{matrix['project_version']}-{suffix}"


def engine_env(engine: Engine) -> dict[str, str]:
    """The environment an engine command runs with (podman: the project's containers.conf,
    unless the caller set their own)."""
    env = dict(os.environ)
    if engine is Engine.PODMAN:
        env.setdefault("CONTAINERS_CONF", str(PODMAN_CONF))
    return env


def detect_engine() -> Engine:
    """docker when a Docker engine answers (not just its client), else podman if installed."""
    if shutil.which("docker"):
        ok = subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
        if ok:
            return Engine.DOCKER
    if shutil.which("podman"):
        return Engine.PODMAN
    raise RuntimeError("no container engine: a Docker engine does not answer `docker info` and podman is "
                       "not installed (`make images` installs podman: scripts/install_containers.sh)")


def pip_ca_bundle() -> str | None:
    """The CA bundle this host's pip trusts, if one is configured (PIP_CERT or pip's `cert`)."""
    cert = os.environ.get("PIP_CERT")
    if not cert:
        try:
            out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.cert"],
                                 capture_output=True, text=True, timeout=30)
            cert = out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            cert = None
    return cert if cert and Path(cert).is_file() else None


def _family(matrix: dict[str, Any], name: str) -> dict[str, Any]:
    families = {f["name"]: f for f in matrix["families"]}
    if name not in families:
        raise ValueError(f"unknown family '{name}'; known: {', '.join(families)}, cpu")
    fam = families[name]
    if fam["status"] != "supported":
        raise ValueError(f"{name} (sm{fam['sm']}) is not supported: {' '.join(fam['reason'].split())}")
    return fam


def build_command(matrix: dict[str, Any], name: str, engine: Engine = Engine.DOCKER, *,
                  base_image: str | None = None, stand_in: bool = False,
                  ca_bundle: str | None = None) -> list[str]:
    """The build argv for one family name (or 'cpu'); ValueError if unsupported.
    `base_image`: the CPU image's base (default: the matrix's); `stand_in`: a GPU family built
    on the local Debian base instead of the CUDA image (tagged ...-standin)."""
    dockerfile = "docker/cpu.Dockerfile" if name == "cpu" else "docker/gpu.Dockerfile"
    cmd = [engine.value, "build", "-f", dockerfile]
    if engine is Engine.PODMAN:
        # docker format: the OCI format drops HEALTHCHECK and SHELL. The context filter of the
        # Dockerfile (docker finds <Dockerfile>.dockerignore itself). Host network: the
        # registries are reached as the host reaches them.
        cmd += ["--format", "docker", "--ignorefile", f"{dockerfile}.dockerignore", "--network", "host"]
    if ca_bundle:
        cmd += ["--secret", f"id=pip_ca,src={ca_bundle}"]
    if name == "cpu":
        if stand_in:
            raise ValueError("--stand-in-base is for GPU families; the CPU image takes --local-base")
        base = base_image or matrix["cpu"]["base_image"]
        if base != matrix["cpu"]["base_image"]:
            cmd += ["--build-arg", f"BASE_IMAGE={base}"]
        return cmd + ["-t", image_tag(matrix, matrix["cpu"]["tag_suffix"]), "."]
    fam = _family(matrix, name)
    tag = image_tag(matrix, f"sm{fam['sm']}") + (STAND_IN_SUFFIX if stand_in else "")
    return cmd + ["--build-arg", f"CUDA_IMAGE={LOCAL_BASE_TAG if stand_in else matrix['stack']['base_image']}",
                  "--build-arg", f"SM={fam['sm']}",
                  "--build-arg", f"TORCH_CUDA_ARCH_LIST={fam['torch_cuda_arch_list']}",
                  "--build-arg", f"GPU_FAMILY={fam['name']}",
                  "--build-arg", f"PYTHON_VERSION={matrix['stack']['python']}",
                  "-t", tag, "."]


def default_names(matrix: dict[str, Any]) -> list[str]:
    """Supported families, one per architecture, then the CPU image."""
    seen: dict[str, str] = {}
    for fam in matrix["families"]:
        if fam["status"] == "supported":
            seen.setdefault(fam["sm"], fam["name"])
    return list(seen.values()) + ["cpu"]


def image_exists(engine: Engine, tag: str) -> bool:
    return subprocess.run([engine.value, "image", "inspect", tag], capture_output=True,
                          env=engine_env(engine), timeout=60).returncode == 0


def image_size_bytes(engine: Engine, tag: str) -> int:
    out = subprocess.run([engine.value, "image", "inspect", "--format", "{{.Size}}", tag],
                         capture_output=True, text=True, env=engine_env(engine), timeout=60, check=True)
    return int(out.stdout.strip())


def ensure_local_base(engine: Engine, log=print) -> float:
    """Build the debootstrap base unless it is there; returns the seconds it took (0 if cached)."""
    if image_exists(engine, LOCAL_BASE_TAG):
        return 0.0
    log(f"building the base {LOCAL_BASE_TAG} from Debian's archive (debootstrap) ...")
    t0 = time.monotonic()
    subprocess.run(["bash", str(DOCKER / "base" / "debian_base.sh"), "--engine", engine.value,
                    "--tag", LOCAL_BASE_TAG], cwd=ROOT, env=engine_env(engine), check=True)
    return time.monotonic() - t0


def build(names: list[str], engine: Engine, *, local_base: bool = False, stand_in: bool = False,
          dry: bool = False, record: Path | None = None, log=print) -> list[dict[str, Any]]:
    """Build (or print) each image; returns one record per image: tag, seconds, bytes."""
    matrix = load_matrix()
    ca = pip_ca_bundle()
    commands = [(n, build_command(matrix, n, engine, stand_in=stand_in and n != "cpu",
                                  base_image=LOCAL_BASE_TAG if local_base and n == "cpu" else None,
                                  ca_bundle=ca)) for n in names]
    results: list[dict[str, Any]] = []
    base_s = 0.0
    if not dry and (local_base or stand_in):
        base_s = ensure_local_base(engine, log)
    for name, cmd in commands:
        log(shlex.join(cmd))
        if dry:
            continue
        t0 = time.monotonic()
        subprocess.run(cmd, cwd=ROOT, env=engine_env(engine), check=True)
        tag = cmd[cmd.index("-t") + 1]
        results.append({"name": name, "tag": tag, "engine": engine.value, "build_s": round(time.monotonic() - t0, 1),
                        "bytes": image_size_bytes(engine, tag),
                        "base": LOCAL_BASE_TAG if (local_base and name == "cpu") or (stand_in and name != "cpu")
                        else None})
    if record is not None and results:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "base_build_s": round(base_s, 1),
                                      "images": results}, indent=1) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="family names from matrix.yaml, or 'cpu'")
    parser.add_argument("--print", dest="dry", action="store_true",
                        help="print the commands instead of running them")
    parser.add_argument("--engine", choices=[e.value for e in Engine], default=None,
                        help="docker or podman (default: docker if its engine answers, else podman)")
    parser.add_argument("--local-base", action="store_true",
                        help="CPU image: a Debian 12 + Python 3.11 base from Debian's archive, no registry")
    parser.add_argument("--stand-in-base", action="store_true",
                        help="GPU families: built on that local base instead of NVIDIA's CUDA image "
                        "(proves everything but CUDA; tagged ...-standin)")
    parser.add_argument("--record", type=Path, default=None,
                        help="write tags, build seconds and image sizes to this JSON file")
    args = parser.parse_args(argv)
    try:
        engine = Engine(args.engine) if args.engine else (Engine.DOCKER if args.dry else detect_engine())
        # build() makes every command (refusing an unsupported family) before it builds anything.
        build(args.names or default_names(load_matrix()), engine, local_base=args.local_base, stand_in=args.stand_in_base, dry=args.dry,
              record=args.record, log=lambda m: print(m, flush=True))
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:
        print(f"error: {shlex.join(map(str, exc.cmd))} exited with {exc.returncode}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
