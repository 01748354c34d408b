"""The container files in docker/: Dockerfile lint, pinned versions, image contents, docs.

No Docker engine exists on the development and CI machines, so images are never built here.
What is tested instead: hadolint on every Dockerfile, every pinned version against
pyproject/requirements/the installed sglang metadata, the architecture guard of the GPU image
(its shell step is executed), that the CPU image runs what `make demo` runs, and that
docs/docker.md covers every image. The compose files: tests/test_docker_compose.py.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from docker_parsing import (DOCKER, DOCKERFILES, MATRIX, ROOT, STACK, arg_defaults, args_of,
                            build_mod, check_stack, flag, hadolint, instructions, interpolate,
                            pins_of, pyproject, requirement_pins)


# ---------------------------------------------------------------- lint
def test_every_dockerfile_passes_hadolint() -> None:
    assert {p.name for p in DOCKERFILES} == {"gpu.Dockerfile", "cpu.Dockerfile"}
    proc = subprocess.run([hadolint(), "--failure-threshold", "info", "--format", "json",
                           *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60)
    findings = json.loads(proc.stdout or "[]")
    assert proc.returncode == 0 and not findings, json.dumps(findings, indent=1)


def test_hadolint_does_report_a_bad_dockerfile(tmp_path: Path) -> None:
    # Guards against a linter that silently checks nothing.
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install curl\nCMD python app.py\n")
    proc = subprocess.run([hadolint(), "--format", "json", str(bad)],
                          capture_output=True, text=True, timeout=60)
    codes = {f["code"] for f in json.loads(proc.stdout)}
    assert proc.returncode != 0
    assert {"DL3007", "DL3025"} <= codes, codes


# ---------------------------------------------------------------- versions
def test_matrix_versions_agree_with_the_install_recipe() -> None:
    torch_pins = requirement_pins(ROOT / "requirements" / "torch.txt")
    assert torch_pins["torch"] == STACK["torch"]
    assert torch_pins["torchvision"] == STACK["torchvision"]
    cpu_pins = requirement_pins(ROOT / "requirements" / "sglang-cpu.txt")
    assert cpu_pins["mooncake-transfer-engine-non-cuda"] == STACK["mooncake"]
    assert cpu_pins["sglang-router"] == STACK["sglang_router"]

    project = pyproject()["project"]
    deps = pins_of(project["dependencies"])
    assert deps["torch"] == STACK["torch"]
    assert deps["transformers"] == requirement_pins(ROOT / "requirements" / "base.txt")["transformers"]
    gpu = pins_of(project["optional-dependencies"]["gpu"])
    assert gpu == {"sglang": STACK["sglang"], "mooncake-transfer-engine": STACK["mooncake"],
                   "sglang-router": STACK["sglang_router"]}
    assert project["version"] == MATRIX["project_version"]
    assert f"sglang=={STACK['sglang']}" in (ROOT / "scripts" / "install.sh").read_text()


def test_matrix_versions_agree_with_sglang_own_pins() -> None:
    meta = md.metadata("sglang")
    assert meta["Version"] == STACK["sglang"]
    requires = pins_of([r for r in meta.get_all("Requires-Dist") if "extra ==" not in r])
    assert requires["torch"] == STACK["torch"]
    assert requires["sglang-kernel"] == STACK["sglang_kernel"]
    assert requires["transformers"] == pins_of(pyproject()["project"]["dependencies"])["transformers"]
    # SGLang 0.5.23 is built on CUDA 13: its CUDA-only dependencies name cu13 variants.
    cuda_major = STACK["cuda"].split(".")[0]
    cu13 = [r for r in meta.get_all("Requires-Dist") if re.search(r"cu\d+", r)]
    assert cu13 and all(f"cu{cuda_major}" in r for r in cu13), cu13
    py = pyproject()["project"]["requires-python"]
    assert py == f">={STACK['python']},<3.{int(STACK['python'].split('.')[1]) + 1}", py


def test_base_images_and_build_args_agree_with_the_matrix() -> None:
    gpu = DOCKER / "gpu.Dockerfile"
    defaults = arg_defaults(gpu)
    assert defaults["CUDA_IMAGE"] == STACK["base_image"]
    assert defaults["PYTHON_VERSION"] == STACK["python"]
    m = re.fullmatch(r"nvidia/cuda:(\d+\.\d+\.\d+)-devel-ubuntu\d+\.\d+", STACK["base_image"])
    assert m and m.group(1) == STACK["cuda"]
    assert STACK["torch_cuda"] == "cu" + "".join(STACK["cuda"].split(".")[:2])
    # The default build (no --build-arg) is a supported family's.
    fams = {f["name"]: f for f in MATRIX["families"]}
    fam = fams[defaults["GPU_FAMILY"]]
    assert fam["status"] == "supported"
    assert (defaults["SM"], defaults["TORCH_CUDA_ARCH_LIST"]) == (fam["sm"], fam["torch_cuda_arch_list"])
    # The CPU image's base is a build argument (the Debian base made here without a registry,
    # docker/base/debian_base.sh), by default the matrix's official Python image.
    cpu = DOCKER / "cpu.Dockerfile"
    assert args_of(cpu, "FROM") == ["${BASE_IMAGE}"]
    assert arg_defaults(cpu)["BASE_IMAGE"] == MATRIX["cpu"]["base_image"]
    assert f"python:{STACK['python']}-" in MATRIX["cpu"]["base_image"]
    base_script = (DOCKER / "base" / "debian_base.sh").read_text()
    assert "bookworm" in MATRIX["cpu"]["base_image"] and " bookworm " in base_script
    assert f"python{STACK['python']}," in base_script and f"python{STACK['python']}-venv" in base_script


def test_check_stack_accepts_this_install_and_names_every_mismatch(tmp_path: Path) -> None:
    # This virtualenv is the CPU install: same torch (CUDA 13.0 build), sglang, router, mooncake.
    assert check_stack.check(MATRIX, gpu=False, sm=None) == []
    assert check_stack.torch_cuda_version() == ".".join(STACK["cuda"].split(".")[:2])
    bad = json.loads(json.dumps(MATRIX))
    bad["stack"]["torch"] = "9.9.9"
    bad["stack"]["cuda"] = "12.8.1"
    problems = check_stack.check(bad, gpu=True, sm="75")
    text = "\n".join(problems)
    assert "torch: installed 2.14.1" in text and "9.9.9" in text
    assert "torch CUDA build: installed 13.0, matrix pins 12.8" in text
    assert "sm75 is not a supported family" in text
    # The script form used by the image builds exits non-zero on a mismatch.
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(bad))
    proc = subprocess.run([sys.executable, str(DOCKER / "check_stack.py"), "--matrix", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "stack mismatch: torch" in proc.stderr


def test_recorded_wheel_archs_explain_the_supported_rows() -> None:
    # A family is supported iff both torch and sglang-kernel carry code that runs on it
    # (SASS for sm_XY runs on sm_XZ with Z >= Y; neither wheel ships PTX for older majors).
    def runs_on(archs: list[str], sm: str) -> bool:
        major, minor = int(sm[:-1]), int(sm[-1])
        for arch in archs:
            digits = arch.removeprefix("sm_").rstrip("a")
            a_major, a_minor = int(digits[:-1]), int(digits[-1])
            specific = arch.endswith("a")  # sm_90a code runs on sm_90 only
            if a_major == major and (a_minor == minor if specific else a_minor <= minor):
                return True
        return False

    for fam in MATRIX["families"]:
        ok = runs_on(STACK["torch_archs"], fam["sm"]) and runs_on(STACK["sglang_kernel_archs"], fam["sm"])
        assert ok == (fam["status"] == "supported"), fam["name"]
        if not ok:
            assert len(fam.get("reason", "")) > 40, fam["name"]


# ---------------------------------------------------------------- images
def guard_script() -> str:
    runs = args_of(DOCKER / "gpu.Dockerfile", "RUN")
    assert runs[0].startswith('case "${SM}" in'), "the architecture guard must be the first RUN"
    return runs[0]


@pytest.mark.parametrize("fam", MATRIX["families"], ids=lambda f: f["name"])
def test_gpu_image_refuses_unsupported_architectures_at_the_first_step(fam: dict[str, Any]) -> None:
    proc = subprocess.run(["bash", "-c", guard_script()], capture_output=True, text=True,
                          env={"SM": fam["sm"], "GPU_FAMILY": fam["name"], "PATH": "/usr/bin:/bin"},
                          timeout=30)
    if fam["status"] == "supported":
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 1
        assert f"sm{fam['sm']} is not supported" in proc.stderr and "docs/docker.md" in proc.stderr


def test_build_script_builds_supported_families_and_refuses_the_others() -> None:
    names = build_mod.default_names(MATRIX)
    assert names[-1] == "cpu"
    sms = [f["sm"] for f in MATRIX["families"] if f["status"] == "supported"]
    assert sorted(n for n in names if n != "cpu") == sorted(
        f["name"] for f in MATRIX["families"] if f["status"] == "supported")
    for name in names[:-1]:
        cmd = build_mod.build_command(MATRIX, name)
        fam = next(f for f in MATRIX["families"] if f["name"] == name)
        assert f"SM={fam['sm']}" in cmd and "-t" in cmd
        assert cmd[cmd.index("-t") + 1] == f"sglang-hack:{MATRIX['project_version']}-sm{fam['sm']}"
    assert len(set(sms)) == len(sms)
    for fam in MATRIX["families"]:
        if fam["status"] != "supported":
            with pytest.raises(ValueError, match="not supported"):
                build_mod.build_command(MATRIX, fam["name"])
    with pytest.raises(ValueError, match="unknown family"):
        build_mod.build_command(MATRIX, "k80")


def test_cpu_image_runs_what_make_demo_runs() -> None:
    makefile = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z_]+)\s*:?=\s*(.+?)\s*$", makefile, re.M))
    recipe = re.search(r"^demo:\s*(.*)\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe, "Makefile has no demo target"
    assert "install" in recipe.group(1).split()
    lines = [ln.strip() for ln in recipe.group(2).splitlines()]
    assert len(lines) == 1, lines
    command = lines[0]
    for _ in range(5):  # expand $(VAR) references
        command = re.sub(r"\$\(([A-Z_]+)\)", lambda m: variables[m.group(1)], command)
    cpu = DOCKER / "cpu.Dockerfile"
    cmd = json.loads(args_of(cpu, "CMD")[-1])
    assert cmd == shlex.split(command)
    # ... from the repository copy, after the same install recipe: its pinned dependencies in a
    # layer of their own (the recipe's files only), then the whole copy and `make install`.
    assert args_of(cpu, "WORKDIR")[-1] == "/opt/sglang-hack"
    copies = args_of(cpu, "COPY")
    assert copies[-1] == ". ." and all(c.split()[0] in ("pyproject.toml", "requirements/", "scripts/install.sh")
                                       for c in copies[:-1]), copies
    runs = args_of(cpu, "RUN")
    assert any("HACK_INSTALL_DEPS_ONLY=1 bash scripts/install.sh" in r for r in runs)
    assert any("&& make install" in r for r in runs)
    # The entry point runs the command as given (after an optional link shaping as root).
    assert json.loads(args_of(cpu, "ENTRYPOINT")[-1]) == ["/opt/sglang-hack/docker/entrypoint.sh"]
    entry = (DOCKER / "entrypoint.sh").read_text()
    assert entry.rstrip().endswith('exec "$@"') and "setpriv --reuid=1000" in entry


def test_install_recipe_stops_before_the_project_when_asked_for_dependencies_only() -> None:
    script = (ROOT / "scripts" / "install.sh").read_text()
    deps_only = script.index('HACK_INSTALL_DEPS_ONLY:-0}" = 1')
    assert script.index("requirements/data.txt") < deps_only < script.index('"$PIP" install -q --no-deps -e .')
    assert deps_only < script.index('echo "$want" > "$STAMP"')   # no stamp: `make install` still runs


def test_gpu_families_share_every_layer_before_their_own_arguments() -> None:
    # One heavy install for all families: the family's build arguments are declared in the
    # image stage only after the last pip install; the guard runs in a stage of its own.
    steps = instructions(DOCKER / "gpu.Dockerfile")
    froms = [i for i, (w, _) in enumerate(steps) if w == "FROM"]
    assert len(froms) == 2 and steps[froms[0]][1].endswith("AS arch-guard")
    image = steps[froms[1]:]
    first_family_arg = next(i for i, (w, a) in enumerate(image) if w == "ARG" and a.startswith("SM="))
    last_pip = max(i for i, (w, a) in enumerate(image) if w == "RUN" and "pip install" in a)
    assert last_pip < first_family_arg
    for word, arg in image[:first_family_arg]:
        assert not re.search(r"\$\{?(SM|GPU_FAMILY|TORCH_CUDA_ARCH_LIST)\b", arg), (word, arg)
    assert ("COPY", "--from=arch-guard /sglang-hack-arch /etc/sglang-hack-arch") in image


def test_gpu_image_serves_through_sglang_with_the_plugin() -> None:
    gpu = DOCKER / "gpu.Dockerfile"
    assert json.loads(args_of(gpu, "ENTRYPOINT")[-1]) == ["python", "-m", "sglang.launch_server"]
    cmd = json.loads(args_of(gpu, "CMD")[-1])
    assert flag(cmd, "--kv-cache-dtype") == "hack"
    assert flag(cmd, "--model-path").startswith("/models/")
    assert any('pip install ".[gpu]"' in r for r in args_of(gpu, "RUN"))
    assert "gpu" in pyproject()["project"]["optional-dependencies"]
    # Every package the project installs reaches the image (`COPY . .` through the allow-list).
    assert ("COPY", ". .") in instructions(gpu)
    ignore = DOCKER / "gpu.Dockerfile.dockerignore"
    for pkg in pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert ignore_allows(ignore, pkg.split("*")[0]), pkg
    for needed in ("pyproject.toml", "README.md", "docker/check_stack.py", "docker/matrix.yaml"):
        assert ignore_allows(ignore, needed), needed


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_unprivileged_with_a_health_check_and_no_secrets(dockerfile: Path) -> None:
    user = args_of(dockerfile, "USER")
    assert user and user[-1].split(":")[0] not in ("root", "0")
    health = args_of(dockerfile, "HEALTHCHECK")
    env = dict(kv.split("=", 1) for e in args_of(dockerfile, "ENV") for kv in shlex.split(e))
    probe = interpolate(health[0] if health else "", env)
    assert len(health) == 1 and "--start-period=" in probe
    assert re.search(r"http://127\.0\.0\.1:\d+/health\b", probe), probe
    secret = re.compile(r"(TOKEN|SECRET|PASSWORD|API_KEY|ACCESS_KEY|HF_TOKEN)", re.I)
    for word in ("ENV", "ARG"):
        for value in args_of(dockerfile, word):
            assert not secret.search(value), f"{dockerfile.name}: {word} {value}"
    for value in args_of(dockerfile, "COPY"):
        assert not re.search(r"\.(safetensors|gguf|bin|pt|pth)\b|models?/", value), value


def ignore_allows(ignore: Path, path: str) -> bool:
    """Whether an allow-list .dockerignore (starting with '*') lets `path` into the context."""
    allowed = False
    for raw in ignore.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        neg, pat = line.startswith("!"), line.lstrip("!").rstrip("/")
        if pat == "*" or path == pat or path.startswith(pat + "/"):
            allowed = neg
    return allowed


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_build_context_is_an_allow_list_that_holds_every_copied_file(dockerfile: Path) -> None:
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    lines = [ln for ln in ignore.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "the context filter must start by excluding everything"
    for junk in (".venv", "runs", "artifacts", ".git", "tests", ".env", "models"):
        assert not ignore_allows(ignore, junk), junk
    for copy in args_of(dockerfile, "COPY"):
        if copy.startswith("--from="):  # from another build stage, not from the context
            continue
        *sources, _dest = copy.split()
        for src in sources:
            if src == ".":
                continue
            assert (ROOT / src).exists(), src
            assert ignore_allows(ignore, src.rstrip("/")), f"{src} is copied but filtered out"


def test_cpu_context_covers_every_project_directory() -> None:
    # `COPY . .` with an allow-list: a new top-level directory must be listed or excluded here.
    ignore = DOCKER / "cpu.Dockerfile.dockerignore"
    not_needed_by_the_demo = {"tests", "docs", "docker", ".ci", ".git", ".venv", "runs",
                              "artifacts", ".pytest_cache", ".hypothesis"}
    for entry in sorted(ROOT.iterdir()):
        if entry.is_dir() and entry.name not in not_needed_by_the_demo \
                and not entry.name.endswith(".egg-info") and entry.name != "__pycache__":
            assert ignore_allows(ignore, entry.name), f"{entry.name}/ is missing from {ignore.name}"
    for needed in ("Makefile", "pyproject.toml", "README.md", "scripts/install.sh", "requirements"):
        assert ignore_allows(ignore, needed), needed


# ---------------------------------------------------------------- docs
def test_docs_cover_every_image_and_the_unsupported_gpus() -> None:
    doc = (ROOT / "docs" / "docker.md").read_text()
    for heading in ("## Which image for which GPU", "## Build", "## Run", "## 1P1D across two hosts",
                    "## RDMA", "## Unsupported GPUs", "## Checks"):
        assert heading in doc, heading
    for fam in MATRIX["families"]:
        for gpu in fam["gpus"]:
            assert gpu in doc, gpu
        if fam["status"] == "supported":
            assert build_mod.image_tag(MATRIX, f"sm{fam['sm']}") in doc, fam["name"]
    assert build_mod.image_tag(MATRIX, "cpu") in doc
    unsupported = doc.split("## Unsupported GPUs", 1)[1].split("\n## ", 1)[0]
    for needle in ("T4", "V100", "sm_70", "sm_75", "INT8", "sglang-kernel", STACK["sglang_kernel"]):
        assert needle in unsupported, needle
    for version in (STACK["sglang"], STACK["torch"], STACK["cuda"], STACK["python"]):
        assert version in doc, version
