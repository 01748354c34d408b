"""Check that the installed Python environment is the stack docker/matrix.yaml pins.

Run at the end of each image build (so a resolver surprise fails the build, not the first
request) and by the tests against the local virtualenv. Reads versions from package metadata
and torch's version file without importing torch, so it is fast and needs no GPU.

    python docker/check_stack.py                 # the CPU/dev install (sglang --no-deps)
    python docker/check_stack.py --gpu --sm 90   # inside a GPU image
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import yaml

MATRIX = Path(__file__).resolve().parent / "matrix.yaml"


def load_matrix(path: Path = MATRIX) -> dict[str, Any]:
    """The build matrix as a dict; raises ValueError if a required section is missing."""
    data = yaml.safe_load(path.read_text())
    for key in ("stack", "families", "cpu"):
        if key not in (data or {}):
            raise ValueError(f"{path}: missing section '{key}'")
    return data


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def torch_cuda_version() -> str | None:
    """CUDA version torch was built with (torch/version.py), or None for a CPU build."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    text = (Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text()
    found = re.search(r"^cuda(?:\s*:\s*[^=]+)?\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else None


def check(matrix: dict[str, Any], gpu: bool, sm: str | None) -> list[str]:
    """Every difference between the environment and the matrix, as readable lines."""
    stack = matrix["stack"]
    problems: list[str] = []

    def expect(what: str, got: str | None, want: str) -> None:
        if got != want:
            problems.append(f"{what}: installed {got or 'nothing'}, matrix pins {want}")

    expect("python", f"{sys.version_info.major}.{sys.version_info.minor}", stack["python"])
    torch = _version("torch")
    expect("torch", torch.split("+")[0] if torch else None, stack["torch"])
    expect("torchvision", (_version("torchvision") or "").split("+")[0] or None,
           stack["torchvision"])
    cuda_mm = ".".join(stack["cuda"].split(".")[:2])
    expect("torch CUDA build", torch_cuda_version(), cuda_mm)
    if stack["torch_cuda"] != "cu" + cuda_mm.replace(".", ""):
        problems.append(f"torch_cuda {stack['torch_cuda']} does not name CUDA {cuda_mm}")
    expect("sglang", _version("sglang"), stack["sglang"])
    expect("sglang-router", _version("sglang-router"), stack["sglang_router"])

    if gpu:
        expect("sglang-kernel", _version("sglang-kernel"), stack["sglang_kernel"])
        expect("mooncake-transfer-engine", _version("mooncake-transfer-engine"),
               stack["mooncake"])
        supported = {f["sm"] for f in matrix["families"] if f["status"] == "supported"}
        if sm not in supported:
            problems.append(f"sm{sm} is not a supported family ({', '.join(sorted(supported))})")
    else:
        expect("mooncake-transfer-engine-non-cuda",
               _version("mooncake-transfer-engine-non-cuda"), stack["mooncake"])
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="check the full CUDA install")
    parser.add_argument("--sm", help="the image's target architecture, e.g. 90 (with --gpu)")
    parser.add_argument("--matrix", type=Path, default=MATRIX)
    args = parser.parse_args(argv)
    if args.gpu and not args.sm:
        parser.error("--gpu needs --sm")
    problems = check(load_matrix(args.matrix), args.gpu, args.sm)
    for line in problems:
        print(f"stack mismatch: {line}", file=sys.stderr)
    if not problems:
        print(f"stack ok ({'gpu sm' + args.sm if args.gpu else 'cpu'})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
