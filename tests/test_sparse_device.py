"""Sparse decode's selection on the pages' device (hack_ops.triton.sparse.select_head_tables), the
GPU kernels' per-head page tables: the same pages as the reference selection (hack_ops.sparse.select)
for every (request, KV head), and the Triton decode kernel over them equal to hack_ops.attention with
the same SparseConfig. On the kernel device (tests/conftest.py: a CUDA GPU when present, else
Triton's interpreter on CPU tensors)."""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig
from hack_ops.attention import attention
from hack_ops.layout import page_layout
from hack_ops.sparse import SparseConfig, select
from hack_ops.triton.decode import HackDecodeAttention
from hack_ops.triton.sparse import select_head_tables
from hack_ops.triton.store import cache_kwargs
from hack_ops.triton.testing import TOL_MAX_ABS, TOL_MEAN_ABS, random_batch, require_kernel_device

HEADS, REP, D, P = 2, 3, 64, 64
LENS = [20 * P + 5, 9 * P, 3 * P + 1, 12 * P + 63]  # past the budget, at it with a full last page, under it
pytestmark = pytest.mark.device
CFG = SparseConfig(budget_tokens=8 * P, recent_tokens=2 * P, dense_layers=0)


@pytest.fixture(autouse=True, scope="module")
def _kernel_device(kernel_device):
    require_kernel_device(kernel_device)


def _case(device):
    lay = page_layout(HackConfig(), HEADS, D)
    b = random_batch(lay, LENS, [0] * len(LENS), HEADS * REP, seed=7, device=device)
    width = max(len(pg) for pg in b["pages"])
    pages = torch.tensor([pg + [pg[0]] * (width - len(pg)) for pg in b["pages"]])
    q = torch.randn(len(LENS), HEADS * REP, D, generator=torch.Generator().manual_seed(8))
    return lay, b, pages, q


def _lists(indptr, indices, i: int, h: int) -> list[int]:
    lo, hi = int(indptr[i]), int(indptr[i + 1])
    n = hi - lo
    return indices[lo * HEADS + h * n:lo * HEADS + (h + 1) * n].tolist()


def test_the_same_pages_as_the_reference(kernel_device):
    lay, b, pages, q = _case(kernel_device)
    indptr, indices, lens = select_head_tables(lay, b["bufs"]["k_buf"], pages.to(kernel_device), LENS,
                                               q.to(kernel_device), CFG)
    indptr, indices, lens = indptr.cpu(), indices.cpu(), lens.cpu()
    closed = torch.tensor([n // P for n in LENS])
    ids = pages[:, :int(closed.max())].long()
    k_buf = b["bufs"]["k_buf"].cpu()
    mn = lay.k.view(k_buf, "minimum")[ids].float().transpose(1, 2)
    sc = lay.k.view(k_buf, "scale")[ids].float().transpose(1, 2)
    index, count = select(q.reshape(len(LENS), HEADS, REP, D), mn, sc, lay.k.bits, closed, CFG, P)
    assert count.tolist() == [8, 8, 3, 8]
    assert lens.tolist() == [8 * P + 5, 8 * P, 3 * P + 1, 8 * P + 63]
    for i, n in enumerate(LENS):
        for h in range(HEADS):
            want = [b["pages"][i][x] for x in index[i, h, :int(count[i])].tolist()]
            if n % P:
                want.append(b["pages"][i][n // P])  # the open page
            assert _lists(indptr, indices, i, h) == want, (i, h)
    assert len({tuple(_lists(indptr, indices, 0, h)) for h in range(HEADS)}) == HEADS  # heads choose apart


def test_the_triton_kernel_on_them_equals_sparse_attention(kernel_device):
    lay, b, pages, q = _case(kernel_device)
    indptr, indices, lens = select_head_tables(lay, b["bufs"]["k_buf"], pages.to(kernel_device), LENS,
                                               q.to(kernel_device), CFG)
    att = HackDecodeAttention(lay, HEADS * REP)
    att.plan(indptr, indices, lens, b["tail_rows"], b["sink_slots"], head_tables=True)
    out = att.run(q.to(kernel_device), **cache_kwargs(b["bufs"]), out=torch.empty(q.shape, device=kernel_device))
    for i, n in enumerate(LENS):
        k, v = b["k"][i].permute(1, 0, 2)[None], b["v"][i].permute(1, 0, 2)[None]
        qi = q[i:i + 1].permute(1, 0, 2)[None]  # the decode row: the last position
        ref = attention(qi, k, v, lay.config, mode="hack", causal=True, sparse=CFG)[0].permute(1, 0, 2)[0]
        err = (out[i].float().cpu() - ref).abs()
        assert err.max() <= TOL_MAX_ABS and err.mean() <= TOL_MEAN_ABS, (i, float(err.max()), float(err.mean()))


def test_what_it_does_not_do_is_refused():
    lay, b, pages, q = _case("cpu")
    for cfg in (SparseConfig(budget_tokens=8 * P, refine=2), SparseConfig(budget_tokens=8 * P, group_pages=4)):
        with pytest.raises(NotImplementedError, match="the bound alone"):
            select_head_tables(lay, b["bufs"]["k_buf"], pages, LENS, q, cfg)
    with pytest.raises(ValueError, match="pages must be"):
        select_head_tables(lay, b["bufs"]["k_buf"], pages[:, :3], LENS, q, CFG)
    with pytest.raises(ValueError, match="q must be"):
        select_head_tables(lay, b["bufs"]["k_buf"], pages, LENS, q[:, :5], CFG)
