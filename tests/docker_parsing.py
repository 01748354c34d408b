"""Parsing for the container-file tests: Dockerfile instructions, compose interpolation, pins."""
from __future__ import annotations

import importlib.resources
import json
import re
import shlex
import shutil
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
sys.path.insert(0, str(DOCKER))
import build_images as build_mod  # noqa: E402,F401  (re-exported for the tests)
import check_stack  # noqa: E402

DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
COMPOSE_FILES = [DOCKER / "compose.yaml", DOCKER / "compose.rdma.yaml", DOCKER / "compose.cpu.yaml"]
MATRIX = check_stack.load_matrix()
STACK = MATRIX["stack"]


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined, heredocs skipped."""
    out: list[tuple[str, str]] = []
    lines = dockerfile.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        while line.endswith("\\") and i < len(lines):
            nxt = lines[i].strip()
            i += 1
            if not nxt.startswith("#"):
                line = line[:-1].rstrip() + " " + nxt
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def args_of(dockerfile: Path, word: str) -> list[str]:
    return [rest for w, rest in instructions(dockerfile) if w == word]


def arg_defaults(dockerfile: Path) -> dict[str, str]:
    return dict(a.split("=", 1) for a in args_of(dockerfile, "ARG") if "=" in a)


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose-style ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, $$."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        val = env.get(name)
        if op in (":-", "-"):
            return val if (val if op == ":-" else val is not None) else arg
        if op in (":?", "?"):
            if (not val) if op == ":?" else val is None:
                raise KeyError(f"{name}: {arg}")
            return val
        return val or ""
    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(:?[-?])?([^}]*)\}", sub, text)


def compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """compose.yaml after interpolation with `env` (the required variables get values)."""
    base = {"HACK_MODELS_DIR": "/srv/models", "HACK_MODEL": "m"}
    return yaml.safe_load(interpolate((DOCKER / "compose.yaml").read_text(), base | (env or {})))


def compose_cpu(env: dict[str, str] | None = None) -> dict[str, Any]:
    """compose.cpu.yaml after interpolation with `env` (nothing is required)."""
    return yaml.safe_load(interpolate((DOCKER / "compose.cpu.yaml").read_text(), env or {}))


def argv(service: dict[str, Any]) -> list[str]:
    cmd = service["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def compose_schema_validator() -> Any:
    from jsonschema import Draft202012Validator
    res = importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor"
    schema = json.loads((res / "compose-spec.json").read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def hadolint() -> str:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe, "hadolint is missing: `make install` installs it (requirements/lint.txt)"
    return exe


def requirement_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line.strip())
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pins_of(specs: list[str]) -> dict[str, str]:
    return {k: v for s in specs for k, v in requirement_pins_from_text(s).items()}


def requirement_pins_from_text(text: str) -> dict[str, str]:
    m = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s;,]+)", text.strip())
    return {m.group(1).lower().replace("_", "-"): m.group(2)} if m else {}
