"""The static page-loop profile (hack_ops.triton.sass_profile): parsing on a written SASS
listing, and, compiled for sm90 in a subprocess (this test process runs Triton's interpreter),
the decode and prefill page loops hold no division slow-path calls, their 16 INT8 MMAs, and
no more one-byte shared-memory accesses than after K's codes were unpacked in-thread."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hack_ops.triton.sass_profile import mma_loop, opcodes, page_loop, profile_sass

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;            /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_CTAID.X ;              /* 0x0000000000007919 */
        /*0020*/                   LDG.E R2, desc[UR4][R2.64] ;      /* 0x0000000402027981 */
        /*0030*/                   LDS.U8 R3, [R0] ;                 /* 0x0000000000037984 */
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;     /* 0x0000000000007b1d */
        /*0050*/                   IMMA.16832.S8.S8.SAT R4, R8, R12, R4 ;
        /*0060*/               @P0 CALL.REL.NOINC 0x100 ;            /* 0x0000000000000944 */
        /*0070*/               @!P1 BRA 0x20 ;                       /* 0x0000000000008947 */
        /*0080*/                   SHFL.BFLY PT, R5, R4, 0x1, 0x1f ;
        /*0090*/                   BRA 0x90 ;
        /*0100*/                   RET.REL.NODEC R20 0x0 ;
"""


def test_parses_the_largest_backward_branch_as_the_page_loop():
    ins = opcodes(SASS)
    assert len(ins) == 11 and ins[6] == (0x60, "CALL.REL.NOINC 0x100")  # predicate dropped
    loop = page_loop(ins)
    assert loop[0].startswith("LDG") and loop[-1] == "BRA 0x20" and len(loop) == 6
    p = profile_sass(SASS, "decode", "x", 90)
    assert (p.total, p.loop, p.barriers, p.shared, p.shared_bytes, p.calls, p.mma, p.shuffles, p.global_loads) == \
        (11, 6, 1, 1, 1, 1, 1, 0, 1)
    with pytest.raises(ValueError, match="no loop"):
        page_loop(opcodes(SASS.replace("@!P1 BRA 0x20", "NOP")))


# nvcc's shape: a loop (0x20..0x70) whose shuffle has a divergent fallback placed after EXIT (entered by
# BRA.DIV, branching back into the loop), which the largest-backward-branch rule takes for the loop.
NVCC_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   MOV R2, RZ ;
        /*0020*/                   LDS.128 R4, [R2] ;
        /*0030*/                   BRA.DIV UR4, 0xa0 ;
        /*0040*/                   SHFL.IDX PT, R5, R4, RZ, 0x1f ;
        /*0050*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0060*/                   IADD3 R2, R2, 0x10, RZ ;
        /*0070*/               @P0 BRA 0x20 ;
        /*0080*/                   EXIT ;
        /*0090*/                   BRA 0x90 ;
        /*00a0*/                   WARPSYNC.COLLECTIVE R3, 0xc0 ;
        /*00b0*/                   SHFL.IDX P2, R5, R4, RZ, 0x1f ;
        /*00c0*/                   BRA 0x50 ;
"""


def test_mma_loop_follows_the_control_flow_graph():
    assert len(page_loop(opcodes(NVCC_SASS))) == 8  # 0x50..0xc0: up to the cold path's branch back
    loop = mma_loop(NVCC_SASS)
    assert loop == ["LDS.128 R4, [R2]", "BRA.DIV UR4, 0xa0", "SHFL.IDX PT, R5, R4, RZ, 0x1f",
                    "HMMA.16816.F32 R8, R4, R6, R8", "IADD3 R2, R2, 0x10, RZ", "BRA 0x20"]
    p = profile_sass(NVCC_SASS, "decode", "x", 90, loop)
    assert (p.loop, p.mma, p.shuffles, p.shared) == (6, 1, 1, 1)
    with pytest.raises(ValueError, match="no loop"):
        mma_loop(NVCC_SASS.replace("@P0 BRA 0x20", "NOP"))


@pytest.mark.slow
def test_page_loops_of_the_default_format_on_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "hack_ops.triton.sass_profile", "--json"], env=env,
                         capture_output=True, text=True, timeout=3600)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = {r["kernel"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert set(rows) == {"decode", "decode_1split", "prefill"}
    for name, r in rows.items():
        assert r["calls"] == 0, f"{name}: an IEEE division is back in the page loop ({r})"
        assert r["mma"] == 16, r  # 2 head_dim groups x (QK^T, PV) x 4 MMA instructions each
        assert r["shared_bytes"] <= 128, f"{name}: code tiles go through shared memory byte by byte again ({r})"
        assert r["loop"] < 2000, r  # 2,627 (decode) and 2,546 (prefill) before; ~1,700 now
