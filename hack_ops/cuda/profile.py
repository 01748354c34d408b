"""What one page costs the CUDA decode kernel, read from its machine code with no GPU: nvcc
-cubin per target (hack_ops.cuda.build), registers and spills from cuobjdump
(hack_ops.triton.aot), the page loop's instructions from the control-flow graph
(hack_ops.triton.sass_profile.mma_loop), shared memory and occupancy from the kernel's geometry.

A warp walks whole pages, so the loop's count is per warp-instruction per page: one iteration
is one 64-token page of one KV head for the whole GQA group. Static counts, not timings.

    python -m hack_ops.cuda.profile                      # head_dim 128, bf16, sm80 and sm90a
    python -m hack_ops.cuda.profile --archs 80,86,89,90 --head-dims 64,128,256 --json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass

from ..triton.aot import cuobjdump
from ..triton.sass_profile import disassemble, mma_loop, profile_sass
from .build import ActDtype, Variant, cubin, host_library
from .fragment import CodeOrder

TARGETS = (80, 86, 89, 90)
REGISTERS_PER_SM = 65536
SMEM_PER_SM = {80: 167936, 86: 102400, 89: 102400, 90: 233472}  # bytes a streaming multiprocessor holds
SMEM_RESERVED = 1024  # per block, sm80+
THREADS = 128


@dataclass(frozen=True)
class KernelProfile:
    variant: str
    arch: int
    regs: int  # per thread
    stack: int  # bytes per thread (spills)
    smem: int  # dynamic shared memory per block (the cp.async rings, then the warps' merge)
    blocks_per_sm: int  # resident blocks: registers and shared memory allow
    loop: int  # instructions of the page loop's body (per warp, per page)
    mma: int  # HMMA in it
    widen: int  # HFMA2 + the code-masking LOP3s (0xea: (a & b) | c)
    permutes: int  # PRMT (joining two tokens' V pieces, pairing side-table halves)
    shared_loads: int  # LDS.* (none byte-wise)
    shared_bytes: int  # 1-byte shared accesses
    cp_async: int  # LDGSTS: 16-byte copies issued for the next page
    barriers: int  # BAR.*: block barriers (none: each warp pipelines its own pages)
    shuffles: int
    total: int  # instructions of the whole kernel


def geometry(head_dim: int) -> dict[str, int]:
    """The kernel's shared-memory layout for head_dim (from the host build of hack_frag.cuh)."""
    lib = ctypes.CDLL(str(host_library()))
    out = (ctypes.c_int64 * 12)()
    if lib.hfh_geometry(head_dim, out):
        raise ValueError(f"no kernel geometry for head_dim {head_dim}")
    names = ("stage", "off_kc", "off_ks", "off_km", "off_vc", "off_vs", "off_vm", "smem", "codes", "tab", "tabp", "vtab")
    return dict(zip(names, out))


def blocks_per_sm(regs: int, smem: int, arch: int) -> int:
    """Resident blocks of THREADS threads: registers are allocated per warp in units of 256."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = REGISTERS_PER_SM // (per_warp * THREADS // 32)
    by_smem = SMEM_PER_SM[arch] // (smem + SMEM_RESERVED)
    return min(by_regs, by_smem, 2048 // THREADS)


def decode_resources(binary: bytes) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) of the decode kernel in a cubin."""
    text = cuobjdump(binary, "--dump-resource-usage")
    if text is None:
        raise RuntimeError("cuobjdump (shipped in triton's wheel) is missing")
    m = re.search(r"Function _ZN4hack18hack_decode_kernel\S*:\s*REG:(\d+) STACK:(\d+)", text)
    if m is None:
        raise ValueError("no hack_decode_kernel in this cubin's resource usage")
    return int(m.group(1)), int(m.group(2))


def decode_sass(sass: str) -> str:
    """The decode kernel's part of a cubin's listing (it also holds the combine kernel)."""
    for part in sass.split("Function : ")[1:]:
        if part.startswith("_ZN4hack18hack_decode_kernel"):
            return part
    raise ValueError("no hack_decode_kernel in this cubin")


def profile(variant: Variant, arch: int) -> KernelProfile:
    binary = cubin(variant, arch)
    regs, stack = decode_resources(binary)
    sass = decode_sass(disassemble(binary))
    loop = mma_loop(sass)
    base = profile_sass(sass, "decode", variant.name, arch, loop)
    ops = Counter(t.split()[0] for t in loop)
    widen = ops["HFMA2"] + sum(1 for t in loop if t.startswith("LOP3.LUT") and t.rstrip().endswith("0xea, !PT"))
    g = geometry(variant.head_dim)  # the host build's, at 2 stages: the rings grow with the variant's
    smem = max(g["smem"], THREADS // 32 * variant.stages * g["stage"])  # each warp its own ring
    return KernelProfile(variant.name, arch, regs, stack, smem, blocks_per_sm(regs, smem, arch), base.loop, base.mma,
                         widen, ops["PRMT"], sum(c for op, c in ops.items() if op.startswith("LDS")),
                         base.shared_bytes, ops["LDGSTS.E.BYPASS.128"] + ops["LDGSTS.E.128"], base.barriers,
                         base.shuffles, base.total)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="80,90")
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--orders", default="token,fragment")
    ap.add_argument("--caps", default="0")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    args = ap.parse_args(argv)
    rows = [profile(Variant(int(d), ActDtype(t), CodeOrder(o), bool(int(c))), int(a))
            for d in args.head_dims.split(",") for t in args.dtypes.split(",") for o in args.orders.split(",")
            for c in args.caps.split(",") for a in args.archs.split(",")]
    if args.json:
        for r in rows:
            print(json.dumps(asdict(r)))
        return 0
    print("CUDA decode kernel: page loop per warp per page (static counts from the cubin, not timings)")
    print("| variant | sm | regs | spills (B) | smem (B) | blocks/SM | loop instr. | MMA | widening | PRMT "
          "| LDS (1-byte) | cp.async | barriers |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.variant} | {r.arch} | {r.regs} | {r.stack} | {r.smem} | {r.blocks_per_sm} | {r.loop} | {r.mma} "
              f"| {r.widen} | {r.permutes} | {r.shared_loads} ({r.shared_bytes}) | {r.cp_async} | {r.barriers} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
