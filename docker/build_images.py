"""Build the images of docker/matrix.yaml (or print the commands).

    python docker/build_images.py --print     # every supported GPU family and the CPU image
    python docker/build_images.py h100 cpu    # build two of them (needs a Docker engine)

Run from anywhere; the build context is the repository root. Asking for a family the matrix
marks unsupported (T4, V100) stops with the reason instead of building a broken image.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_stack import load_matrix  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def image_tag(matrix: dict[str, Any], suffix: str) -> str:
    """`sglang-hack:<version>-<suffix>`, the tag compose.yaml refers to."""
    return f"{matrix['image']}:{matrix['project_version']}-{suffix}"


def build_command(matrix: dict[str, Any], name: str) -> list[str]:
    """The `docker build` argv for one family name (or 'cpu'); ValueError if unsupported."""
    if name == "cpu":
        return ["docker", "build", "-f", "docker/cpu.Dockerfile",
                "-t", image_tag(matrix, matrix["cpu"]["tag_suffix"]), "."]
    families = {f["name"]: f for f in matrix["families"]}
    if name not in families:
        raise ValueError(f"unknown family '{name}'; known: {', '.join(families)}, cpu")
    fam = families[name]
    if fam["status"] != "supported":
        raise ValueError(f"{name} (sm{fam['sm']}) is not supported: {' '.join(fam['reason'].split())}")
    return ["docker", "build", "-f", "docker/gpu.Dockerfile",
            "--build-arg", f"CUDA_IMAGE={matrix['stack']['base_image']}",
            "--build-arg", f"SM={fam['sm']}",
            "--build-arg", f"TORCH_CUDA_ARCH_LIST={fam['torch_cuda_arch_list']}",
            "--build-arg", f"GPU_FAMILY={fam['name']}",
            "--build-arg", f"PYTHON_VERSION={matrix['stack']['python']}",
            "-t", image_tag(matrix, f"sm{fam['sm']}"), "."]


def default_names(matrix: dict[str, Any]) -> list[str]:
    """Supported families, one per architecture, then the CPU image."""
    seen: dict[str, str] = {}
    for fam in matrix["families"]:
        if fam["status"] == "supported":
            seen.setdefault(fam["sm"], fam["name"])
    return list(seen.values()) + ["cpu"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="family names from matrix.yaml, or 'cpu'")
    parser.add_argument("--print", dest="dry", action="store_true",
                        help="print the commands instead of running them")
    args = parser.parse_args(argv)
    matrix = load_matrix()
    try:
        commands = [build_command(matrix, n) for n in (args.names or default_names(matrix))]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for cmd in commands:
        print(shlex.join(cmd), flush=True)
        if not args.dry:
            subprocess.run(cmd, cwd=ROOT, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
