"""The CUDA decode kernel compiled for real targets with no GPU (nvcc -cubin, cached), and its
machine code held to numbers (hack_ops.cuda.profile): no spills, registers that leave three
blocks per SM on sm80 and sm90a, and per 64-token page per warp one tensor-core MMA program
(80 HMMAs at head_dim 128), one instruction per code to widen, no block barrier, no byte-wise
shared memory, and fewer instructions than the budget docs/kernels.md states. Static counts, not
timings. Skipped with the reason where nvcc or Triton's cuobjdump is missing.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from hack_ops.cuda.build import ActDtype, Variant, nvcc
from hack_ops.cuda.fragment import CodeOrder


def _cuobjdump_missing() -> bool:
    try:
        import triton
    except ImportError:
        return True
    return not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists()


pytestmark = [
    pytest.mark.skipif(nvcc() is None, reason="nvcc is not installed: the CUDA kernel cannot be compiled here"),
    pytest.mark.skipif(_cuobjdump_missing(), reason="Triton's wheel ships no cuobjdump: cubins cannot be read"),
]

# Instructions of the page loop per warp per page, head_dim 128 (measured 1,220-1,244 token
# order, 1,148-1,167 fragment order with nvcc 13.0; the Triton kernel: 1,706 per thread x 4 warps).
LOOP_BUDGET = {CodeOrder.TOKEN: 1300, CodeOrder.FRAGMENT: 1220}


@pytest.fixture(scope="module")
def profiles():
    from hack_ops.cuda.profile import profile

    return {(order, arch): profile(Variant(128, ActDtype.BF16, order), arch)
            for order in CodeOrder for arch in (80, 90)}


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("order", list(CodeOrder))
def test_head_dim_128_fits_without_spills(profiles, order, arch):
    p = profiles[(order, arch)]
    assert p.stack == 0, p  # no register spills
    assert p.regs <= 168 and p.blocks_per_sm >= 3, p  # 12 warps per SM
    assert p.smem == 41984, p  # 4 warps x 2 stages x 5,248 B (one head's page and side tables)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("order", list(CodeOrder))
def test_page_loop_is_the_tensor_core_program(profiles, order, arch):
    p = profiles[(order, arch)]
    assert p.mma == 80, p  # Q·m_K 16 (head + residual), Sᵀ 32, Oᵀ 32
    assert p.widen == 512, p  # 512 codes per lane per page: one LOP3 + one HFMA2 per pair
    assert p.barriers == 0 and p.shared_bytes == 0, p
    assert p.cp_async == 10, p  # 5,120 bytes of the next page per warp: 16 bytes x 32 lanes x 10
    assert p.loop <= LOOP_BUDGET[order], p


@pytest.mark.parametrize("order", list(CodeOrder))
def test_three_stages_keep_three_blocks_on_sm90(order):
    """The 3-stage ring: 62,976 B of shared memory per block, still no spills and 3 blocks per SM
    on sm90a (228 KB of shared memory), the same page program."""
    from hack_ops.cuda.profile import profile

    p = profile(Variant(128, ActDtype.BF16, order, stages=3), 90)
    assert p.stack == 0 and p.regs <= 168 and p.blocks_per_sm >= 3, p
    assert p.smem == 4 * 3 * 5248, p
    assert p.mma == 80 and p.widen == 512 and p.cp_async == 10 and p.barriers == 0, p
    assert p.loop <= LOOP_BUDGET[order], p


def test_fragment_order_saves_the_token_pairing(profiles):
    """Fragment order reads a lane's V words directly: fewer permutes and shared loads per page."""
    for arch in (80, 90):
        tok, frag = profiles[(CodeOrder.TOKEN, arch)], profiles[(CodeOrder.FRAGMENT, arch)]
        assert frag.permutes == tok.permutes - 16 and frag.shared_loads < tok.shared_loads
        assert frag.loop < tok.loop


@pytest.mark.slow
@pytest.mark.parametrize("d,cap,arch,blocks", [
    (64, False, 80, 4), (64, False, 90, 4),
    # head_dim 256: 83 KB of rings per block, one block per SM where a block may hold 99 KB
    (256, True, 86, 1), (256, True, 90, 2),
])
def test_other_head_dims_and_soft_capping_fit(d, cap, arch, blocks):
    from hack_ops.cuda.profile import profile

    p = profile(Variant(d, ActDtype.FP16, CodeOrder.TOKEN, cap), arch)
    assert p.stack == 0 and p.barriers == 0 and p.shared_bytes == 0, p
    assert p.blocks_per_sm >= blocks, p
    assert p.mma == {64: 40, 256: 160}[d] and p.widen == 4 * d, p
