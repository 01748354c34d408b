"""Build the CUDA decode and store kernels with nvcc, once per machine, and cache it (hack_ops.cbuild's
pattern: the key covers the sources, the flags and the tools' versions; the file appears by an
atomic rename, so concurrent builders never see half of one).

Five products:
  library(variant, arch)  the kernel for one variant and GPU architecture, a shared library with
                          host launchers (ctypes, hack_ops.cuda.launch); nvcc's static CUDA
                          runtime, so nothing else is needed at run time
  store_library(variant, arch)  the prefill store (csrc/hack_store.cu: head_dim and input dtype
                          of the variant; hack_ops.cuda.store), built with -fmad=false so its
                          bytes are hack_ops.quant's
  cubin(variant, arch)    the device code only, for the static checks (hack_ops.cuda.profile)
  host_library()          the kernel's per-thread arithmetic compiled for the CPU (the tests)
  simt_library(variant)   the whole kernel source compiled for the CPU, lanes as fibers (the tests)
One variant per library (head_dim, activation dtype, code order, soft-capping): a server builds
the few its layers use, in a few seconds each.

    python -m hack_ops.cuda.build --arch 90 --head-dims 128 --dtypes bf16,fp16   # prebuild, in parallel
Environment: NVCC picks the compiler (default: nvcc on PATH, then /usr/local/cuda/bin/nvcc);
HACK_KERNEL_CACHE the cache directory (shared with the CPU kernels).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Sequence

from ..cbuild import cache_dir
from .fragment import CodeOrder

SRC = Path(__file__).parent / "csrc"
DECODE_SOURCE = SRC / "hack_decode.cu"
STORE_SOURCE = SRC / "hack_store.cu"
HOST_SOURCE = SRC / "hack_frag_host.cu"
SIMT_SOURCE = SRC / "hack_simt_host.cpp"
HEADERS = (SRC / "hack_frag.cuh", SRC / "hack_params.h", SRC / "hack_simt.cuh", DECODE_SOURCE, STORE_SOURCE,
           SRC / "hack_store_params.h")
# The store's arithmetic must be the reference's, operation for operation: no fused multiply-adds.
STORE_FLAGS = ("-fmad=false",)
BASE_FLAGS = ("-std=c++17", "-O3", "-Xcompiler", "-fPIC")
MIN_ARCH = 80  # mma.sync m16n8k16 f16, cp.async, movmatrix: Ampere and newer
STAGES = (2, 3)  # the decode kernel's ring depths: 2 serves; 3 is measured beside it (bench_decode_cuda)


class ActDtype(StrEnum):
    """The dtype of the queries and the output (the model's activations)."""

    BF16 = "bf16"
    FP16 = "fp16"


@dataclass(frozen=True)
class Variant:
    head_dim: int = 128
    dtype: ActDtype = ActDtype.BF16
    order: CodeOrder = CodeOrder.TOKEN
    cap: bool = False  # the layer soft-caps its logits
    stages: int = 2    # pages in flight per warp (the decode kernel's cp.async ring)

    def __post_init__(self) -> None:
        if self.stages not in STAGES:
            raise ValueError(f"stages must be one of {STAGES}, got {self.stages}")

    @property
    def name(self) -> str:
        extra = "" if self.stages == 2 else f"-s{self.stages}"
        return f"d{self.head_dim}-{self.dtype.value}-{self.order.value}{'-cap' if self.cap else ''}{extra}"

    def defines(self) -> list[str]:
        return [f"-DHACK_D={self.head_dim}", f"-DHACK_T={0 if self.dtype == ActDtype.BF16 else 1}",
                f"-DHACK_ORDER={0 if self.order == CodeOrder.TOKEN else 1}", f"-DHACK_CAP={int(self.cap)}",
                f"-DHACK_STAGES={self.stages}"]


def nvcc() -> str | None:
    found = os.environ.get("NVCC") or shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def arch_flag(arch: int) -> str:
    """nvcc's target for sm_<arch>; Hopper as sm_90a (its full instruction set)."""
    if arch < MIN_ARCH:
        raise ValueError(f"the CUDA decode kernel needs sm_{MIN_ARCH} or newer, got sm_{arch}")
    suffix = "a" if arch == 90 else ""
    return f"-gencode=arch=compute_{arch}{suffix},code=sm_{arch}{suffix}"


def device_arch(device=None) -> int:
    """sm number of a CUDA device (torch), e.g. 90 for an H100."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _versions(tool: str) -> str:
    out = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
    host = shutil.which(os.environ.get("CXX", "g++")) or ""
    if host:
        out += subprocess.run([host, "--version"], capture_output=True, text=True).stdout
    return out


def _build(stem: str, source: Path, flags: Sequence[str], suffix: str, what: str) -> Path:
    """Compile `source` with `flags` into `<cache>/cuda/<stem>_<key><suffix>` unless it is there."""
    missing = [p.name for p in (source, *HEADERS) if not p.exists()]
    if missing:
        raise RuntimeError(f"the sources of {what} {missing} are not installed")
    tool = nvcc()
    if tool is None:
        raise RuntimeError("nvcc not found (install the CUDA toolkit, or set NVCC)")
    text = "".join(p.read_text() for p in (source, *HEADERS))
    key = hashlib.sha256((text + " ".join(flags) + _versions(tool)).encode()).hexdigest()[:16]
    out = cache_dir() / "cuda" / f"{stem}_{key}{suffix}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        res = subprocess.run([tool, *flags, "-I", str(SRC), "-o", str(tmp_out), str(source)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building {what} failed:\n{res.stderr[-3000:]}")
        os.replace(tmp_out, out)
    return out


def library(variant: Variant, arch: int) -> Path:
    """The decode kernel of `variant` for sm_<arch>, as a shared library with its launchers."""
    flags = [*BASE_FLAGS, "--shared", arch_flag(arch), *variant.defines()]
    return _build(f"hack_decode_{variant.name}_sm{arch}", DECODE_SOURCE, flags, ".so", f"the CUDA decode kernel ({variant.name})")


def cubin(variant: Variant, arch: int) -> bytes:
    """The device code of `variant` for sm_<arch> (no host code), for the static checks."""
    flags = [*BASE_FLAGS, "-cubin", arch_flag(arch), *variant.defines()]
    path = _build(f"hack_decode_{variant.name}_sm{arch}", DECODE_SOURCE, flags, ".cubin",
                  f"the CUDA decode kernel's cubin ({variant.name}, sm_{arch})")
    return path.read_bytes()


def store_name(variant: Variant) -> str:
    """The store depends on head_dim and the input dtype only."""
    return f"d{variant.head_dim}-{variant.dtype.value}"


def store_library(variant: Variant, arch: int) -> Path:
    """The store kernel for `variant`'s head_dim and input dtype on sm_<arch>, with its launcher."""
    flags = [*BASE_FLAGS, *STORE_FLAGS, "--shared", arch_flag(arch), *variant.defines()]
    name = store_name(variant)
    return _build(f"hack_store_{name}_sm{arch}", STORE_SOURCE, flags, ".so", f"the CUDA store kernel ({name})")


def store_cubin(variant: Variant, arch: int) -> bytes:
    """The store kernel's device code for sm_<arch>, for the static checks."""
    flags = [*BASE_FLAGS, *STORE_FLAGS, "-cubin", arch_flag(arch), *variant.defines()]
    name = store_name(variant)
    path = _build(f"hack_store_{name}_sm{arch}", STORE_SOURCE, flags, ".cubin",
                  f"the CUDA store kernel's cubin ({name}, sm_{arch})")
    return path.read_bytes()


def simt_library(variant: Variant) -> Path:
    """The kernels' own sources built for the CPU (csrc/hack_simt_host.cpp: lanes as fibers,
    collectives emulated), for the CPU tests; nvcc drives the host compiler (-x c++), so the CUDA
    headers resolve as for the device build."""
    flags = ["-std=c++20", "-O1", "-x", "c++", "-Xcompiler", "-fPIC", "-Xcompiler", "-ffp-contract=off", "--shared",
             "-cudart", "none", *variant.defines()]
    return _build(f"hack_simt_{variant.name}", SIMT_SOURCE, flags, ".so", f"the CUDA kernel's CPU harness ({variant.name})")


def host_library() -> Path:
    """The kernel's per-thread arithmetic for the CPU (hack_frag_host.cu): no device code."""
    return _build("hack_frag_host", HOST_SOURCE, [*BASE_FLAGS, "--shared", "-cudart", "none"], ".so",
                  "the CUDA kernel's host model")


def prebuild(variants: Sequence[Variant], arch: int, workers: int | None = None) -> list[Path]:
    """Build several variants at once (nvcc is single-threaded; a GPU machine has cores), and the
    store of each head_dim and dtype among them."""
    stores = list({store_name(v): v for v in variants}.values())
    jobs = [(library, v) for v in variants] + [(store_library, v) for v in stores]
    with ThreadPoolExecutor(max_workers=workers or min(len(jobs), os.cpu_count() or 1) or 1) as ex:
        return list(ex.map(lambda job: job[0](job[1], arch), jobs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="prebuild the CUDA decode kernel's libraries")
    ap.add_argument("--arch", type=int, default=None, help="sm number (default: the GPU's)")
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--orders", default="token,fragment")
    ap.add_argument("--caps", default="0,1")
    ap.add_argument("--stages", default="2", help=f"decode ring depths, of {STAGES}")
    args = ap.parse_args(argv)
    arch = args.arch or device_arch()
    variants = [Variant(int(d), ActDtype(t), CodeOrder(o), bool(int(c)), int(n))
                for d in args.head_dims.split(",") for t in args.dtypes.split(",")
                for o in args.orders.split(",") for c in args.caps.split(",") for n in args.stages.split(",")]
    for path in prebuild(variants, arch):
        print(f"sm_{arch}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
