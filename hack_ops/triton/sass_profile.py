"""What one page of attention costs a GPU thread, read from the compiled machine code, no GPU.

The decode and prefill kernels spend their time in one loop over a request's closed pages.
This module compiles a kernel ahead of time (hack_ops.triton.aot: the wrappers' own launch,
for sm_<arch>), disassembles the cubin with the cuobjdump shipped in Triton's wheel, finds the
page loop (the largest backward branch) and counts, per iteration and per thread:
instructions, block barriers, shared-memory loads/stores (and how many move single bytes:
layout conversions of INT8 tiles done one code at a time), subroutine calls (in these kernels
each marks an IEEE division: the call to its slow path, branched around for ordinary operands,
follows the reciprocal and range check every division executes), tensor-core MMAs, warp
shuffles and global loads.

Measured on an H200 (docs/kernels.md), decode ran at ~1 of 4 instructions per cycle per SM
with 2 blocks per SM: the loop is bound by its instruction stream, its barriers and its
latency, not by HBM bandwidth, so these counts are the quantity to lower between GPU runs.
They are not timings: say so wherever they are quoted.

    python -m hack_ops.triton.sass_profile                       # default format, sm90
    python -m hack_ops.triton.sass_profile --variants P64-D256-mqa4-swa-cap --arch 80
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass

import triton

from .aot import VARIANTS, compile_launch, cuobjdump, example_launches

LOOP_KERNELS = ("decode", "decode_1split", "prefill")
_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)")


@dataclass(frozen=True)
class LoopProfile:
    """Per-thread SASS of one iteration of a kernel's page loop."""

    kernel: str
    variant: str
    arch: int
    triton: str
    total: int  # instructions of the whole kernel
    loop: int  # instructions of the page loop's body
    barriers: int  # BAR.* (block-wide synchronizations)
    shared: int  # LDS/STS/LDSM (shared memory accesses)
    shared_bytes: int  # LDS.U8/STS.U8: one code per access
    calls: int  # CALL.* (here: one per IEEE division, its slow path)
    mma: int  # IMMA/HMMA tensor-core instructions
    shuffles: int  # SHFL.* (cross-lane reductions)
    global_loads: int  # LDG.*


def opcodes(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text without predicate) of every instruction in a SASS listing."""
    out = []
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m:
            out.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2))))
    return out


def page_loop(ins: list[tuple[int, str]]) -> list[str]:
    """The body of the largest loop (a backward branch to the lowest target spanning the most
    instructions): in these kernels, the walk over a request's closed pages."""
    at = {a: i for i, (a, _) in enumerate(ins)}
    best = None
    for i, (a, text) in enumerate(ins):
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            span = (at[int(m.group(1), 16)], i)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    if best is None:
        raise ValueError("no loop in this kernel's SASS")
    return [t for _, t in ins[best[0]:best[1] + 1]]


_BRA_TARGET = re.compile(r"^BRA(?:\.\w+)*\s+(?:`\()?0x([0-9a-f]+)")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def mma_loop(sass: str) -> list[str]:
    """The body of the natural loop holding the most tensor-core MMAs, from the control-flow graph
    (blocks, dominators, back edges), for nvcc's code: it puts rarely taken paths (a warp's
    divergent-shuffle fallback, entered by BRA.DIV) after the kernel's exit, whence they branch
    back into the loop, so the largest backward branch (page_loop) is not the loop there.
    BRA.DIV's target is left out of the graph (never taken by a converged warp); every other block
    of the loop counts once, conditional ones included."""
    ins = []
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m:
            text = m.group(2)
            ins.append((int(m.group(1), 16), _PREDICATE.sub("", text), bool(_PREDICATE.match(text))))
    if not ins:
        raise ValueError("no instructions in this SASS")
    at = {a: i for i, (a, _, _) in enumerate(ins)}

    def target(text: str) -> int | None:
        m = _BRA_TARGET.match(text)
        return at.get(int(m.group(1), 16)) if m and not text.startswith("BRA.DIV") else None

    ends = ("BRA", "EXIT", "RET", "JMP")
    leaders = {0}
    for i, (_, text, _) in enumerate(ins):
        if text.startswith(ends):
            leaders.add(i + 1)
            tgt = target(text)
            if tgt is not None:
                leaders.add(tgt)
    starts = sorted(x for x in leaders if x < len(ins))
    block_of = {}
    for b, lo in enumerate(starts):
        for i in range(lo, starts[b + 1] if b + 1 < len(starts) else len(ins)):
            block_of[i] = b
    nb = len(starts)
    last = [(starts[b + 1] if b + 1 < nb else len(ins)) - 1 for b in range(nb)]
    succ: list[list[int]] = []
    for b in range(nb):
        _, text, pred = ins[last[b]]
        nxt = [b + 1] if b + 1 < nb else []
        tgt = target(text)
        if text.startswith(("EXIT", "RET")) or (tgt is not None and not pred and text.startswith("BRA")):
            out = [] if tgt is None else [block_of[tgt]]
            out += nxt if pred else []
        else:
            out = nxt + ([block_of[tgt]] if tgt is not None else [])
        succ.append(out)
    reach, stack = {0}, [0]  # blocks the entry reaches; the cold paths left out above are not among them
    while stack:
        for c in succ[stack.pop()]:
            if c not in reach:
                reach.add(c)
                stack.append(c)
    preds: list[list[int]] = [[] for _ in range(nb)]
    for b in reach:
        for c in succ[b]:
            preds[c].append(b)
    dom = [set(range(nb)) for _ in range(nb)]
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in range(1, nb):
            ps = [dom[p] for p in preds[b]]
            new = ({b} | set.intersection(*ps)) if ps else {b}
            if new != dom[b]:
                dom[b], changed = new, True
    best: tuple[int, int, list[int]] | None = None
    for u in sorted(reach):
        for h in succ[u]:
            if h not in dom[u]:
                continue  # not a back edge
            body, stack = {h, u}, [u]
            while stack:
                for p in preds[stack.pop()]:
                    if p not in body:
                        body.add(p)
                        stack.append(p)
            texts = [ins[i][1] for blk in sorted(body) for i in range(starts[blk], last[blk] + 1)]
            key = (sum(t.startswith(("HMMA", "IMMA")) for t in texts), len(texts), texts)
            if best is None or key[:2] > best[:2]:
                best = key
    if best is None:
        raise ValueError("no loop in this kernel's SASS")
    return best[2]


def profile_sass(sass: str, kernel: str, variant: str, arch: int, loop: list[str] | None = None) -> LoopProfile:
    """Counts of one loop iteration: `loop` (instruction texts) or, by default, page_loop's."""
    ins = opcodes(sass)
    ops = Counter(t.split()[0] for t in (page_loop(ins) if loop is None else loop))

    def n(*prefixes: str) -> int:
        return sum(c for op, c in ops.items() if op.startswith(prefixes))

    return LoopProfile(kernel, variant, arch, triton.__version__, len(ins), sum(ops.values()), n("BAR"),
                       n("LDS", "STS"), ops["LDS.U8"] + ops["STS.U8"], n("CALL"), n("IMMA", "HMMA"), n("SHFL"),
                       n("LDG"))


def disassemble(cubin: bytes) -> str:
    sass = cuobjdump(cubin, "--dump-sass")
    if not sass:
        raise RuntimeError("cuobjdump (shipped in triton's wheel) is missing or printed no SASS")
    return sass


def profile(variant_names: list[str], arch: int = 90, kernels: tuple[str, ...] = LOOP_KERNELS) -> list[LoopProfile]:
    rows = []
    for v in VARIANTS:
        if v.name not in variant_names:
            continue
        for name, launch in example_launches(v).items():
            if name in kernels:
                rows.append(profile_sass(disassemble(compile_launch(launch, arch).asm["cubin"]), name, v.name, arch))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=VARIANTS[0].name, help=f"comma-separated, of {[v.name for v in VARIANTS]}")
    ap.add_argument("--arch", type=int, default=90, help="sm_<arch> to compile for (default 90: H100/H200)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    unknown = set(names) - {v.name for v in VARIANTS}
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: {[v.name for v in VARIANTS]}")
    rows = profile(names, args.arch)
    if args.json:
        for r in rows:
            print(json.dumps(asdict(r)))
        return 0
    print(f"page-loop SASS per thread per iteration (static counts, not timings), triton {triton.__version__}")
    print("| kernel | variant | sm | instructions (loop / kernel) | barriers | shared (1-byte) | calls | MMA | shuffles | global loads |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.kernel} | {r.variant} | {r.arch} | {r.loop} / {r.total} | {r.barriers} | {r.shared} ({r.shared_bytes}) "
              f"| {r.calls} | {r.mma} | {r.shuffles} | {r.global_loads} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
