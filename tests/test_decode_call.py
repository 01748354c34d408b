"""The compiled decode call as a served layer makes it: the model's query dtype converted and
scaled inside the kernel, the output written in bfloat16 there, the plan's index inputs built
once per plan, and the prepared sparse selection's inputs; each against the float32 call."""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig
from hack_ops.paged import cpu_kernel, decode
from hack_ops.paged.benchcases import DecodeCase
from hack_ops.paged.sparse import SparseDecode, select_for_decode
from hack_ops.sparse import SparseConfig

pytestmark = pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler: the CPU kernel cannot be built")


@pytest.fixture(scope="module")
def case() -> DecodeCase:
    return DecodeCase(6, 2, 64, 3, 1000, HackConfig(partition_size=32, sink_tokens=4), seed=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_queries_converted_and_scaled_inside_equal_the_float_call(case, dtype):
    q = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = 0.1  # not a power of two: the product rounds as torch rounds it
    inside = cpu_kernel.decode(case.store, 0, case.plan, q, scale)
    outside = cpu_kernel.decode(case.store, 0, case.plan, (q.float() * scale).contiguous(), 1.0)
    assert inside.dtype == torch.float32 and torch.equal(inside, outside)
    strided = cpu_kernel.decode(case.store, 0, case.plan, q.transpose(0, 1).contiguous().transpose(0, 1), scale)
    assert torch.equal(strided, outside)  # (not contiguous: converted by torch first)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_outputs_in_the_model_dtype_equal_the_converted_float_output(case, dtype):
    q = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(2)).to(dtype) * 4
    f32 = cpu_kernel.decode(case.store, 0, case.plan, q, 0.125)
    out = cpu_kernel.decode(case.store, 0, case.plan, q, 0.125, out_dtype=dtype)
    assert out.dtype == dtype and torch.equal(out.view(torch.int16), f32.to(dtype).view(torch.int16))
    served = decode(case.store, 0, case.plan, q, scale=0.125)  # what the backend calls
    assert served.dtype == dtype and torch.equal(served, out)


def test_a_prepared_selection_feeds_the_kernel_as_a_fresh_one(case):
    cfg = SparseConfig(budget_tokens=8 * 32, recent_tokens=64, dense_layers=0)
    q = case.q
    step = SparseDecode(cfg)
    sel = step.select(case.store, 0, case.plan, q)
    fresh = select_for_decode(case.store, 0, case.plan, q, cfg)
    seq, ncl, table = sel.kernel_inputs()
    ref = fresh.kernel_inputs()
    assert torch.equal(seq, ref[0]) and torch.equal(ncl, ref[1]) and torch.equal(table, ref[2])
    assert torch.equal(ncl, seq // 32) and sel.closed_read() == fresh.closed_read() == int(fresh.n_closed.sum())
    assert torch.equal(decode(case.store, 0, case.plan, q, sparse=step),
                       decode(case.store, 0, case.plan, q, sparse=SparseDecode(cfg)))
