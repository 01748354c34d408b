"""Sparse decode's selection on the pages' device (hack_ops.triton.sparse.select_head_tables), the
GPU kernels' per-head page tables: the same pages as the reference selection (hack_ops.sparse.select)
for every (request, KV head), and the Triton decode kernel over them equal to hack_ops.attention with
the same SparseConfig; its parts: the page-score kernel (hack_ops.triton.page_bound) against
hack_ops.sparse.page_scores, select_pages with a host width against its own, the CSR built from host counts against
PageSelection.head_csr, and the whole selection run on meta tensors, which refuse any read-back.
On the kernel device (tests/conftest.py: a CUDA GPU when present, else Triton's interpreter on CPU
tensors)."""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig
from hack_ops.attention import attention
from hack_ops.layout import page_layout
from hack_ops.paged.sparse import PageSelection
from hack_ops.sparse import PageScore, SparseConfig, page_scores, select, select_pages
from hack_ops.triton import sparse as device_sparse
from hack_ops.triton.decode import HackDecodeAttention
from hack_ops.triton.page_bound import page_bound_scores
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


def _side_tables(meta: str, heads: int, d: int, n_closed: list[int], seed: int):
    """A layout's K pages with only their minimum and scale filled (what the scores read), and a
    shuffled page table padded with -1 (an id the kernel must never read)."""
    lay = page_layout(HackConfig(meta_dtype=meta), heads, d)
    g = torch.Generator().manual_seed(seed)
    total = sum(n_closed) + 2
    k_buf = torch.zeros(total, lay.k.page_bytes, dtype=torch.uint8)
    lay.k.view(k_buf, "minimum").copy_(torch.randn(total, heads, d, generator=g))
    lay.k.view(k_buf, "scale").copy_(torch.rand(total, heads, d, generator=g) * 0.5)
    perm = torch.randperm(total, generator=g).tolist()
    width = max(n_closed)
    rows = []
    for n in n_closed:
        rows.append(perm[:n] + [-1] * (width - n))
        perm = perm[n:]
    return lay, k_buf, torch.tensor(rows, dtype=torch.int32)


# fp32 sums in another order than the reference's matmul: relative to the largest score
SCORE_RTOL = 1e-5


@pytest.mark.parametrize("meta", ["float16", "float32"])
@pytest.mark.parametrize("rep", [1, 3, 7, 8])
@pytest.mark.parametrize("d", [64, 128])
def test_page_score_kernel_equals_page_scores(kernel_device, meta, rep, d):
    heads, n_closed = 2, [5, 0, 2, 19]  # unequal lengths, one request without a closed page
    lay, k_buf, ids = _side_tables(meta, heads, d, n_closed, seed=rep * d)
    q = torch.randn(len(n_closed), heads * rep, d, generator=torch.Generator().manual_seed(rep))
    width = max(n_closed)
    got = page_bound_scores(lay, k_buf.to(kernel_device), ids.to(kernel_device),
                            torch.tensor(n_closed, device=kernel_device), width, q.to(kernel_device)).cpu()
    valid = torch.arange(width)[None, :] < torch.tensor(n_closed)[:, None]  # [B, N]
    safe = torch.where(valid, ids.long(), 0)
    mn = lay.k.view(k_buf, "minimum")[safe].transpose(1, 2)
    sc = lay.k.view(k_buf, "scale")[safe].transpose(1, 2)
    want = page_scores(q.reshape(len(n_closed), heads, rep, d), mn, sc, lay.k.bits)
    assert got.dtype == torch.float32 and got.shape == want.shape
    v = valid[:, None, :].expand_as(want)
    torch.testing.assert_close(got[v], want[v], rtol=SCORE_RTOL, atol=SCORE_RTOL * float(want[v].abs().max()))
    assert bool((got[~v] == float("-inf")).all())


def test_page_score_kernel_linear_score(kernel_device):
    heads, rep, d, n_closed = 2, 3, 64, [4, 7]
    lay, k_buf, ids = _side_tables("float16", heads, d, n_closed, seed=3)
    q = torch.randn(2, heads * rep, d, generator=torch.Generator().manual_seed(4))
    got = page_bound_scores(lay, k_buf.to(kernel_device), ids.to(kernel_device),
                            torch.tensor(n_closed, device=kernel_device), 7, q.to(kernel_device),
                            PageScore.LINEAR).cpu()
    safe = ids.long().clamp(min=0)
    mn = lay.k.view(k_buf, "minimum")[safe].transpose(1, 2)
    sc = lay.k.view(k_buf, "scale")[safe].transpose(1, 2)
    want = page_scores(q.reshape(2, heads, rep, d), mn, sc, lay.k.bits, PageScore.LINEAR)
    atol = SCORE_RTOL * float(want.abs().max())
    torch.testing.assert_close(got[1], want[1], rtol=SCORE_RTOL, atol=atol)
    torch.testing.assert_close(got[0, :, :4], want[0, :, :4], rtol=SCORE_RTOL, atol=atol)
    assert bool((got[0, :, 4:] == float("-inf")).all())


def test_select_pages_with_a_host_width_is_the_same_choice():
    """select_pages with the width the GPU path knows on the host (no read-back of max(count))
    gives the very index it computes itself: a request without closed pages, a tie, padding."""
    g = torch.Generator().manual_seed(5)
    budget, recent = 4, 2
    n_closed = [9, 0, 3, 4, 12]
    n = max(n_closed)
    scores = torch.randn(len(n_closed), 3, n, generator=g)
    scores[:, :, 5] = scores[:, :, 6]  # a tie among the candidates
    nc = torch.tensor(n_closed)
    scores = scores.masked_fill(torch.arange(n)[None, None, :] >= nc[:, None, None], float("-inf"))
    recent_from = nc - recent
    want_idx, want_count = select_pages(scores, nc, budget, recent_from)
    count = [min(c, budget) for c in n_closed]
    assert want_count.tolist() == count
    got_idx, got_count = select_pages(scores, nc, budget, recent_from, width=max(count))
    assert torch.equal(got_idx, want_idx) and torch.equal(got_count, want_count)
    zero = torch.zeros(5, dtype=torch.long)
    assert select_pages(scores[:, :, :1], zero, budget, recent_from, width=0)[0].shape == (5, 3, 0)


def test_csr_from_host_counts_equals_head_csr():
    """PageSelection.head_csr_from_host (what device_selection's head_csr runs) gives head_csr's
    very tensors: a request without closed pages, one whose open page is empty, padding after."""
    p, h, w = 16, 3, 5
    n_closed, open_tokens = [4, 0, 2, 3], [5, 7, 0, 15]
    g = torch.Generator().manual_seed(6)
    table = torch.randint(0, 1000, (4, h, w), generator=g)
    lens = torch.tensor([c * p + o for c, o in zip(n_closed, open_tokens)])
    sel = PageSelection(page_size=p, positions=torch.zeros(4, h, w, dtype=torch.long), table=table,
                        n_closed=torch.tensor(n_closed), seq_lens=lens, resident=torch.tensor(n_closed))
    want = sel.head_csr()
    got = sel.head_csr_from_host([c + int(o > 0) for c, o in zip(n_closed, open_tokens)])
    assert all(x.dtype == torch.int32 for x in got) and all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="n_pages must be"):
        sel.head_csr_from_host([w + 1, 0, 0, 0])


def test_device_selection_csr_equals_head_csr(kernel_device):
    lay, b, pages, q = _case(kernel_device)
    sel = device_sparse.device_selection(lay, b["bufs"]["k_buf"], pages.to(kernel_device), LENS,
                                         q.to(kernel_device), CFG)
    got, want = sel.head_csr(), PageSelection.head_csr(sel)  # host counts / the boolean gather
    assert all(torch.equal(a.cpu(), w.cpu()) for a, w in zip(got, want))
    assert sel.closed_read() == PageSelection.closed_read(sel)


def test_the_selection_reads_nothing_back(monkeypatch):
    """Meta tensors have shapes and no data: .item(), .tolist(), a boolean-mask gather or
    nonzero() on one raises. The whole selection after the score kernel (which cannot run on
    them: its scores are stood in for) runs on them, so nothing in it waits for device values."""
    lay, b, pages, q = _case("cpu")
    k_meta = b["bufs"]["k_buf"].to("meta")

    def scores(layout, k_buf, ids, n_closed, width, q_, score):
        assert k_buf.device.type == ids.device.type == n_closed.device.type == q_.device.type == "meta"
        return torch.empty(len(LENS), HEADS, width, device="meta")

    monkeypatch.setattr(device_sparse, "page_bound_scores", scores)
    indptr, indices, lens = select_head_tables(lay, k_meta, pages.to("meta"), LENS, q.to("meta"), CFG)
    per_head = [8 + 1, 8, 3 + 1, 8 + 1]  # closed pages read (the budget's 8 at most), then the open page
    assert indptr.shape == (len(LENS) + 1,) and indices.shape == (sum(per_head) * HEADS,) and lens.shape == (4,)
    assert indptr.device.type == indices.device.type == "meta" and indices.dtype == torch.int32
    sel = device_sparse.device_selection(lay, k_meta, pages.to("meta"), LENS, q.to("meta"), CFG)
    assert sel.closed_read() == 8 + 8 + 3 + 8  # the totals' pages read, from the host
    with pytest.raises((RuntimeError, NotImplementedError)):  # the boolean gather does read back
        PageSelection.head_csr(sel)
