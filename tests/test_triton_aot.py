"""Ahead-of-time compilation of the Triton kernels for real GPU targets, with no GPU here.

`python -m hack_ops.triton.aot` builds each kernel's launch with the wrappers' own code and
compiles it with triton.compile(..., target=GPUTarget("cuda", cc, 32)) for sm80/86/89/90
(INT8 MMA) and sm70/75 (the fp16 fallback). It runs in a subprocess: this test process runs
Triton in its CPU interpreter, and compiling needs the normal mode. What is checked: every
kernel compiles for every target (a kernel that only works in the interpreter fails here),
fits the target's shared memory, does not spill, and docs/bench/aot-triton.md (linked from
docs/kernels.md) shows these numbers; the kernels with K codes of other bits than V's (HackConfig.k_bits) compile without spills too.
On a CUDA machine (tests/conftest.py), the same launches also run on the GPU and the driver's
register counts are checked against the AOT numbers for that GPU's architecture.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hack_ops import HackConfig
from hack_ops.triton.aot import (DOC_BEGIN, DOC_END, DOT_KERNELS, FALLBACK_TARGETS, SMEM_LIMIT, TARGETS, VARIANTS,
                                 Compiled, Variant, _resource_usage, _signature, compile_launch, example_launches,
                                 markdown, update_docs)
from hack_ops.triton.spec import int8_mma_supported

DOCS = Path(__file__).resolve().parent.parent / "docs" / "bench" / "aot-triton.md"  # linked from docs/kernels.md
DEFAULT = VARIANTS[0].name  # the serving default: Π=64, D=128, GQA 4
KERNELS = ("store", "store_tail", "prefill", "decode", "decode_combine", "decode_1split")


class _Job:
    """One compile batch in a subprocess (no interpreter there), started at once, read when a
    test asks for it."""

    def __init__(self, args: list[str], json_out: Path | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self.json_out = json_out
        self.proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def rows(self) -> list[Compiled]:
        out, err = self.proc.communicate(timeout=3600)
        assert self.proc.returncode == 0, err[-4000:]
        data = json.loads(self.json_out.read_text()) if self.json_out else json.loads(out.strip().splitlines()[-1])
        return [Compiled(**r) for r in data]


def _window_variant() -> Variant:
    return next(v for v in VARIANTS if v.window is not None and v.logit_cap > 0)


@pytest.fixture(scope="module")
def aot_jobs(tmp_path_factory):
    """The module's three compile batches, started together: each compiles one kernel at a time
    and keeps about half a core busy (ptxas in between), so on a 2-core host they overlap almost
    for free (sequentially they took 8.4 min of a 2-core AMD EPYC, 2026-11-28)."""
    tmp = tmp_path_factory.mktemp("aot")
    jobs = {
        "default": _Job(["-m", "hack_ops.triton.aot", "--variants", DEFAULT, "--json", str(tmp / "default.json")],
                        tmp / "default.json"),
        "window": _Job(["-m", "hack_ops.triton.aot", "--variants", _window_variant().name, "--targets", "80,90",
                        "--fallback-targets", "", "--json", str(tmp / "window.json")], tmp / "window.json"),
        "split_bits": _Job(["-c", SPLIT_BITS_AOT]),
    }
    yield jobs
    for job in jobs.values():
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()


@pytest.fixture(scope="module")
def compiled(aot_jobs) -> list[Compiled]:
    return aot_jobs["default"].rows()


@pytest.mark.slow
def test_every_kernel_compiles_for_every_target(compiled):
    got = {(r.kernel, r.arch, r.path) for r in compiled}
    want = {(k, a, "int8") for k in KERNELS for a in TARGETS}
    want |= {(k, a, "fp16") for k in DOT_KERNELS for a in FALLBACK_TARGETS}
    assert got == want


@pytest.mark.slow
def test_resources_fit_and_int8_path_does_not_spill(compiled):
    """Shared memory fits every target; the INT8 path of the default format keeps everything
    in registers. (The fp16 fallback's FMA dots do spill a little: recorded in the docs.)"""
    for r in compiled:
        assert r.shared <= SMEM_LIMIT[r.arch], r
        assert r.regs is not None and r.regs <= 255, r
        assert "b32:" in r.ptx_regs, r  # the PTX register declarations were read
        if r.path == "int8":
            assert r.stack == 0, f"{r.kernel} sm{r.arch} spills {r.stack} B per thread"


@pytest.mark.slow
def test_docs_show_these_numbers(compiled):
    """docs/bench/aot-triton.md carries the generated table (python -m hack_ops.triton.aot
    --update-docs docs/bench/aot-triton.md); it must match what this Triton produces."""
    text = DOCS.read_text()
    assert DOC_BEGIN in text and DOC_END in text
    table = text.split(DOC_BEGIN, 1)[1].split(DOC_END, 1)[0]
    for line in markdown(compiled).splitlines()[2:]:
        assert line in table, f"stale docs row, regenerate the table: {line}"


@pytest.mark.slow
def test_window_and_soft_cap_variants_compile_without_spills(aot_jobs):
    """The sliding-window + soft-cap kernels at Gemma's shape (1 KV head, head_dim 256) compile
    for sm80 and sm90, fit shared memory and keep everything in registers."""
    launches = example_launches(_window_variant())
    assert launches["decode"].constexprs["WINDOW"] and launches["decode"].constexprs["CAP"]
    assert launches["prefill"].constexprs["WINDOW"] and launches["prefill"].constexprs["CAP"]
    rows = aot_jobs["window"].rows()
    assert {(r.kernel, r.arch) for r in rows} == {(k, a) for k in KERNELS for a in (80, 90)}
    for r in rows:
        assert r.shared <= SMEM_LIMIT[r.arch], r
        assert r.stack == 0, f"{r.kernel} sm{r.arch} spills {r.stack} B per thread"


# K and V with their own bits (HackConfig.k_bits) at the serving default's shape: 4-bit K with
# 2-bit V and the reverse. Compiled in a subprocess like the CLI (no interpreter there).
SPLIT_BITS_AOT = """
import json
from dataclasses import asdict
from hack_ops.config import HackConfig
from hack_ops.triton.aot import Variant, compile_all
vs = [Variant("P64-D128-gqa4-K4V2", HackConfig(k_bits=4), 8, 32, 128),
      Variant("P64-D128-gqa4-K2V4", HackConfig(kv_bits=4, k_bits=2), 8, 32, 128)]
rows = compile_all(vs, (80, 90), (), ("store", "prefill", "decode"))
print(json.dumps([asdict(r) for r in rows]))
"""


@pytest.mark.slow
def test_split_bits_variants_compile_without_spills(aot_jobs):
    """The store, prefill and decode kernels with K codes of other bits than V's compile for
    sm80 and sm90, fit shared memory and keep everything in registers."""
    rows = aot_jobs["split_bits"].rows()
    assert {(r.kernel, r.variant, r.arch) for r in rows} == {
        (k, v, a) for k in ("store", "prefill", "decode") for v in ("P64-D128-gqa4-K4V2", "P64-D128-gqa4-K2V4")
        for a in (80, 90)}
    for r in rows:
        assert r.shared <= SMEM_LIMIT[r.arch], r
        assert r.stack == 0, f"{r.kernel} {r.variant} sm{r.arch} spills {r.stack} B per thread"


def test_split_bits_launches_carry_each_tensors_bits():
    """The launches the wrappers build pass K's bits and V's bits as separate constants."""
    v = Variant("K4V2", HackConfig(k_bits=4), 2, 4, 64)
    for name, launch in example_launches(v).items():
        if "K_BITS" in launch.constexprs:
            assert (launch.constexprs["K_BITS"], launch.constexprs["V_BITS"]) == (4, 2), name
    assert {"store", "prefill", "decode", "decode_1split"} <= {
        n for n, launch in example_launches(v).items() if "K_BITS" in launch.constexprs}


def test_signature_follows_launcher_specialization():
    """Integers divisible by 16 get the divisibility hint, 1 becomes a constant, tensors map to
    typed pointers: the compiled code is what Triton's launcher would build on a GPU."""
    launch = example_launches(VARIANTS[0])["decode"]
    sig, consts, attrs = _signature(launch)
    names = launch.kernel.arg_names
    assert sig["q_ptr"] == "*bf16" and sig["kc_ptr"] == "*i32" and sig["ksum_ptr"] == "*u8"
    assert sig["sm_scale"] == "fp32"
    assert all(sig[n] == "constexpr" for n in launch.constexprs)
    assert attrs[(names.index("q_ptr"),)] == [["tt.divisibility", 16]]
    ints = [(n, a) for n, a in zip([n for n in names if n not in launch.constexprs], launch.args) if type(a) is int]
    for n, a in ints:
        if a == 1:
            assert sig[n] == "constexpr" and consts[n] == 1
        elif a % 16 == 0:
            assert attrs[(names.index(n),)] == [["tt.divisibility", 16]]


def test_update_docs_replaces_only_the_table(tmp_path):
    doc = tmp_path / "k.md"
    doc.write_text(f"# K\n\n## CPU path\ntext\n\n## Triton (GPU)\nbefore\n{DOC_BEGIN}\nold\n{DOC_END}\nafter\n")
    update_docs(doc, "| new |")
    text = doc.read_text()
    assert "old" not in text and "| new |" in text
    assert text.startswith("# K\n\n## CPU path\ntext\n") and text.endswith(f"{DOC_END}\nafter\n")
    plain = tmp_path / "plain.md"
    plain.write_text("# nothing here\n")
    with pytest.raises(ValueError, match="markers"):
        update_docs(plain, "| x |")
    assert plain.read_text() == "# nothing here\n"


@pytest.mark.cuda
def test_launches_run_on_the_gpu_with_the_aot_registers(kernel_device):
    """Every kernel of the serving default runs on this GPU, and the registers per thread the
    driver reports equal what the AOT compile + cuobjdump give for this architecture (so the
    table above says what a GPU would see); no spills where the AOT compile found none."""
    major, minor = torch.cuda.get_device_capability(kernel_device)
    arch = 10 * major + minor
    dot_f16 = not int8_mma_supported(kernel_device)
    for name, launch in example_launches(VARIANTS[0], dot_f16=dot_f16, device=kernel_device).items():
        kernel = launch.kernel[launch.grid](*launch.args, **launch.constexprs, **launch.options)
        torch.cuda.synchronize(kernel_device)
        regs, stack = _resource_usage(compile_launch(launch, arch).asm["cubin"])
        assert regs is not None, "cuobjdump (shipped in triton's wheel) is missing"
        assert kernel.n_regs == regs, f"{name} sm{arch}: driver {kernel.n_regs} registers, AOT {regs}"
        if stack == 0:
            assert kernel.n_spills == 0, f"{name} sm{arch}: {kernel.n_spills} spills on the device"
