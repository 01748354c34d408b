"""Sparse decode (hack_ops.sparse, hack_ops.paged.sparse): pages scored from K's own side tables.

What must hold: the bound is an upper bound of every score a page's quantized keys give
(random and uneven channels here; a real model's K in tests/test_sparse_real.py); the
selection keeps what it must (the first page, the recent pages, the budget, one list per KV
head); a sparse step equals the dense reference run on the shorter sequence of the selected
pages (hack_ops.sparse.gather_sequence), on the compiled kernel and the PyTorch path; with every
page selected it is the dense step, bit for bit.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from hack_ops import HackConfig, attention
from hack_ops.paged import decode
from hack_ops.paged.sparse import SparseDecode, select_for_decode
from hack_ops.quant import dequantize, quantize
from hack_ops.sparse import (PageScore, SparseConfig, gather_sequence, group_boxes, page_best, page_scores, select,
                             select_pages)
from test_paged_attention import FLIP_TOL, ROUNDOFF_TOL, Case, _need_kernel, make_cfg

P = 32


def _pages_of(k: torch.Tensor, bits: int, p: int = P):
    """K [L, D] quantized per channel over pages of p tokens as the store does it: the
    quantized tensor, the per-page minimum and scale [n, D] and the dequantized keys."""
    qt = quantize(k, bits, dim=0, group_size=p, meta_dtype=torch.float16)
    return qt, qt.minimum.float(), qt.scale.float(), dequantize(qt)


@pytest.mark.parametrize("bits", [2, 4])
def test_bound_is_above_every_score_of_the_page(bits):
    g = torch.Generator().manual_seed(1)
    d, n_pages, rep = 64, 24, 3
    chan = (1 + torch.arange(d) % 7).float()
    k = torch.randn(n_pages * P, d, generator=g) * chan + torch.randn(d, generator=g) * 3
    q = torch.randn(rep, d, generator=g) * 2
    _, mn, sc, kd = _pages_of(k, bits)
    bound = page_scores(q, mn, sc, bits)  # [n]
    true = (q @ kd.T).reshape(rep, n_pages, P).amax(-1).amax(0)  # best score of each page
    slack = bound - true
    assert float(slack.min()) >= -1e-3 * float(true.abs().max()), float(slack.min())
    # and the tightest such bound: a page holding the box's corner that q points to gives it exactly
    corner = k[:P].clone()
    lo, hi = corner.amin(0), corner.amax(0)
    corner[5] = torch.where(q[0] > 0, hi, lo)
    _, cmn, csc, ckd = _pages_of(corner, bits)
    exact = float((q[:1] @ ckd.T).max())
    assert abs(float(page_scores(q[:1], cmn, csc, bits)[0]) - exact) <= 1e-3 * abs(exact)
    # MPCache's linear stand-in is no bound (it can fall below a page's best score)
    lin = page_scores(q, mn, sc, bits, PageScore.LINEAR)
    assert bool((lin <= bound + 1e-4).all())


def test_group_box_bounds_its_pages():
    g = torch.Generator().manual_seed(2)
    d = 64
    k = torch.randn(10 * P, d, generator=g) * (1 + torch.arange(d) % 5)
    q = torch.randn(2, d, generator=g)
    _, mn, sc, _ = _pages_of(k, 2)
    gmin, gsc = group_boxes(mn, sc, 2, 4)  # 3 groups, the last of 2 pages
    assert gmin.shape == (3, d)
    pages, groups = page_scores(q, mn, sc, 2), page_scores(q, gmin, gsc, 2)
    for i in range(10):
        assert float(groups[i // 4]) >= float(pages[i]) - 1e-4


def test_selection_keeps_what_it_must():
    cfg = SparseConfig(budget_tokens=6 * P, recent_tokens=2 * P)
    g = torch.Generator().manual_seed(3)
    n_closed = torch.tensor([20, 5, 6, 40])
    scores = torch.randn(4, 2, 40, generator=g)
    scores[0, 0, 10] = scores[0, 1, 3] = 1e6  # each head its own favourite page
    idx, count = select_pages(scores, n_closed, cfg.budget_pages(P), n_closed - cfg.recent_pages(P))
    assert count.tolist() == [6, 5, 6, 6]
    for b in range(4):
        nc, c = int(n_closed[b]), int(count[b])
        for h in range(2):
            got = idx[b, h, :c].tolist()
            assert got == sorted(got) and len(set(got)) == c and max(got) < nc
            assert 0 in got and {nc - 1, nc - 2} <= set(got)  # the first page and the recent ones
            if nc > c:  # the best-scored of the rest fill the budget
                rest = [j for j in range(1, nc - 2)]
                top = sorted(rest, key=lambda j: -float(scores[b, h, j]))[:c - 3]
                assert set(got) == {0, nc - 2, nc - 1, *top}
    assert 10 in idx[0, 0, :6].tolist() and 3 in idx[0, 1, :6].tolist()


def test_two_level_selection_chooses_within_the_kept_groups():
    cfg = SparseConfig(budget_tokens=4 * P, recent_tokens=P, group_pages=4, group_keep=1.0)
    g = torch.Generator().manual_seed(4)
    d, n = 64, 32
    k = torch.randn(n * P, d, generator=g)
    k[13 * P + 5] += 40  # one hot key in page 13 (group 3)
    q = (k[13 * P + 5] / k[13 * P + 5].norm())[None, None, None, :].repeat(1, 1, 2, 1)
    _, mn, sc, _ = _pages_of(k, 2)
    idx, count = select(q, mn[None, None], sc[None, None], 2, torch.tensor([n]), cfg, P)
    got = idx[0, 0, :int(count[0])].tolist()
    assert 13 in got and 0 in got and n - 1 in got
    flat, _ = select(q, mn[None, None], sc[None, None], 2, torch.tensor([n]), SparseConfig(budget_tokens=4 * P,
                                                                                        recent_tokens=P), P)
    assert 13 in flat[0, 0].tolist()


def test_refinement_finds_the_page_the_bound_misses():
    """Pages whose keys spread wide in every channel have boxes that reach high for any query, so
    the bound ranks them above the one page holding the key the query matches; refined, the
    candidates' own keys decide, and that page is read."""
    g = torch.Generator().manual_seed(21)
    d, n = 64, 24
    k = torch.randn(n * P, d, generator=g)
    q = torch.randn(d, generator=g)
    for page in (3, 5, 7, 9, 11):  # wide boxes: two keys at opposite corners, neither close to q
        sign = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0)
        k[page * P + 4], k[page * P + 9] = 4 * sign, -4 * sign
    k[15 * P + 7] = 2 * q  # the key the query looks for
    qt, mn, sc, kd = _pages_of(k, 2)
    qg = q[None, None, None, :].repeat(1, 1, 2, 1)  # one KV head, two query heads
    cfg = SparseConfig(budget_tokens=6 * P, recent_tokens=2 * P)  # the first page, two recent, three free
    bound_idx, count = select(qg, mn[None, None], sc[None, None], 2, torch.tensor([n]), cfg, P)
    assert int(count[0]) == 6 and 15 not in bound_idx[0, 0].tolist()
    assert set(bound_idx[0, 0].tolist()) < {0, 3, 5, 7, 9, 11, n - 2, n - 1}
    best = page_best(qg, kd[None, None], P)  # [1, 1, n]
    refined = SparseConfig(budget_tokens=6 * P, recent_tokens=2 * P, refine=2)
    idx, count = select(qg, mn[None, None], sc[None, None], 2, torch.tensor([n]), refined, P, best)
    got = idx[0, 0, :int(count[0])].tolist()
    assert int(count[0]) == 6 and 15 in got and {0, n - 2, n - 1} <= set(got)
    with pytest.raises(ValueError, match="page_best"):
        select(qg, mn[None, None], sc[None, None], 2, torch.tensor([n]), refined, P)
    # refinement only reorders the bound's candidates: with one candidate per slot it is the bound
    same, _ = select(qg, mn[None, None], sc[None, None], 2, torch.tensor([n]),
                     SparseConfig(budget_tokens=6 * P, recent_tokens=2 * P, refine=1), P, best)
    assert torch.equal(same, bound_idx)


def _decode_step(cfg: HackConfig, d: int, rep: int, seed: int):
    """Four requests (open pages, a page just closed, one under the budget) whose last token is
    the decode step of layer 0, its K/V written: (case, plan, that step's queries [4, Hq, D])."""
    lens = [20 * P + 7, 9 * P, 3 * P + 1, 14 * P + 30]
    case = Case(cfg, lens=lens, heads=2, rep=rep, head_dim=d, seed=seed)
    case.extend([n - 1 for n in lens])
    plan = case.store.plan(case.table, case.rows, lens)
    q = torch.stack([case.q[i][n - 1] for i, n in enumerate(lens)])
    case.store.write(0, plan, torch.stack([case.k[i][n - 1] for i, n in enumerate(lens)]),
                     torch.stack([case.v[i][n - 1] for i, n in enumerate(lens)]))
    return case, plan, q


@pytest.mark.parametrize("groups", [0, 2], ids=lambda g: f"groups{g}")
@pytest.mark.parametrize("geometry", [(64, 3), (128, 4)], ids=lambda g: f"d{g[0]}-rep{g[1]}")
@pytest.mark.parametrize("kw", [dict(sink_tokens=4), dict(sink_tokens=0, k_bits=4)],
                         ids=lambda kw: make_cfg(partition_size=P, **kw).label())
def test_compiled_refinement_ranks_candidates_as_the_reference(kw, geometry, groups):
    """hack_select.c's refinement scores each candidate with the decode kernel's INT8 scores;
    the PyTorch path with the float scores of the dequantized keys. Both read the same
    candidates (with two levels: the kept groups' pages, from the cached boxes) and keep the
    same counts; where their choices differ, the pages swapped score within the INT8 round-off
    of each other."""
    _need_kernel("native")
    from hack_ops.paged.group_boxes import GroupBoxCache
    from hack_ops.paged.sparse import closed_page_best, closed_page_meta, kernel_select

    d, rep = geometry
    case, plan, q = _decode_step(make_cfg(partition_size=P, **kw), d, rep, seed=12)
    mn, sc, n_closed = closed_page_meta(case.store, 0, plan)
    bits = case.store.layout_for(0).k.bits
    best = closed_page_best(case.store, 0, plan, q)
    two = dict(group_pages=groups, group_keep=1.5) if groups else {}
    plain = SparseConfig(budget_tokens=6 * P, recent_tokens=2 * P, **two)
    bound_idx, _ = select(q.reshape(4, 2, rep, -1), mn, sc, bits, n_closed, plain, P)
    boxes = GroupBoxCache(groups) if groups else None
    for refine in (2, 3):
        sparse = SparseConfig(budget_tokens=6 * P, recent_tokens=2 * P, refine=refine, **two)
        idx, count = select(q.reshape(4, 2, rep, -1), mn, sc, bits, n_closed, sparse, P, best)
        compiled = kernel_select(case.store, 0, plan, q, sparse, boxes)
        assert torch.equal(compiled.n_closed, count)
        changed = 0
        for b in range(4):
            c = int(count[b])
            for h in range(2):
                want, got = set(idx[b, h, :c].tolist()), set(compiled.positions[b, h, :c].tolist())
                changed += want != set(bound_idx[b, h, :c].tolist())
                row = best[b, h]
                tol = 0.02 * float(row[:int(n_closed[b])].abs().max())
                if got != want:
                    assert min(float(row[i]) for i in got - want) >= max(float(row[i]) for i in want - got) - tol
        assert changed, "the refinement chose as the bound did everywhere: the test shows nothing"


def _sparse_reference(case: Case, i: int, positions: torch.Tensor, n_closed: int) -> torch.Tensor:
    """Request i's decode output at its last position, each KV head attending the shorter
    sequence of its n_closed selected closed pages, then the open partition, by the dense
    reference."""
    t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    length = case.done[i]
    h = case.k[i].shape[1]
    rep = case.q[i].shape[1] // h
    outs = []
    for head in range(h):
        pages = positions[head, :n_closed]
        ks = gather_sequence(case.k[i][:length, head:head + 1], pages, P)
        vs = gather_sequence(case.v[i][:length, head:head + 1], pages, P)
        q = case.q[i][length - 1:length, head * rep:(head + 1) * rep]
        outs.append(attention(t(q), t(ks), t(vs), case.cfg, mode="hack")[0].transpose(0, 1)[-1])
    return torch.cat(outs, 0)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("kw", [dict(sink_tokens=4), dict(sink_tokens=0, k_bits=4), dict(sink_tokens=1, kv_bits=4)],
                         ids=lambda kw: make_cfg(partition_size=P, **kw).label())
@pytest.mark.parametrize("refine", [1, 3])
def test_sparse_decode_is_the_dense_step_over_the_selected_pages(kw, backend, refine):
    if backend == "cpu":
        _need_kernel("native")
    cfg = make_cfg(partition_size=P, **kw)
    lens = [20 * P + 7, 9 * P, 3 * P + 1, 14 * P + 30]  # open pages, a page just closed, under the budget
    case = Case(cfg, lens=lens, heads=2, rep=3, seed=5)
    case.extend([n - 1 for n in lens])
    sparse = SparseDecode(SparseConfig(budget_tokens=6 * P, recent_tokens=2 * P, dense_layers=0, refine=refine))
    outs = case.decode(backend=backend, sparse=sparse)
    sel = sparse.last
    assert sel is not None and sel.n_closed.tolist() == [6, 6, 3, 6]
    for i in range(len(lens)):
        ref = _sparse_reference(case, i, sel.positions[i], int(sel.n_closed[i]))
        err = (outs[i] - ref).abs().amax(-1)
        assert float(err.max()) <= FLIP_TOL, (i, float(err.max()))
        case.errs.append(err)
    case.finish()
    # heads chose differently somewhere (else per-head tables would not be needed)
    assert any(not torch.equal(sel.positions[i, 0], sel.positions[i, 1]) for i in (0, 3))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_every_page_selected_is_the_dense_step(backend):
    """A budget as large as the context routes through the per-head tables with every page in
    them: the same bytes read in the same order, so the dense step's output exactly."""
    if backend == "cpu":
        _need_kernel("native")
    from hack_ops.paged.sparse import PageSelection, _as_table

    cfg = make_cfg(partition_size=P, sink_tokens=4)
    lens = [10 * P + 3, 7 * P]
    outs = {}
    for way in ("dense", "all-selected"):
        case = Case(cfg, lens=lens, seed=8)
        case.extend([n - 1 for n in lens])
        if way == "dense":
            outs[way] = case.decode(backend=backend)
            continue
        plan = case.store.plan(case.table, case.rows, lens)
        nc = plan.seq_lens // P
        idx = torch.arange(int(nc.max()))[None, None, :].repeat(2, 2, 1)
        sel: PageSelection = _as_table(plan, idx, nc, nc, P)
        q = torch.stack([case.q[i][n - 1] for i, n in enumerate(lens)])
        k = torch.stack([case.k[i][n - 1] for i, n in enumerate(lens)])
        v = torch.stack([case.v[i][n - 1] for i, n in enumerate(lens)])
        fixed = _Fixed(sel)
        o = decode(case.store, 0, plan, q, k, v, backend=backend, sparse=fixed)
        outs[way] = {i: o[i] for i in range(2)}
    for i in range(2):
        assert torch.equal(outs["dense"][i], outs["all-selected"][i]), i


class _Fixed(SparseDecode):
    """A SparseDecode that hands out a prepared selection (to compare paths on the same pages)."""

    def __init__(self, sel):
        super().__init__(SparseConfig(budget_tokens=P, dense_layers=0))
        self._sel = sel

    def select(self, store, layer, plan, q):
        return self._sel


def test_layers_share_a_selection_and_counts_are_kept():
    cfg = make_cfg(partition_size=P, sink_tokens=4)
    lens = [16 * P + 3]
    case = Case(cfg, lens=lens, seed=9)
    case.extend([lens[0] - 1])
    plan = case.store.plan(case.table, case.rows, lens)
    sparse = SparseDecode(SparseConfig(budget_tokens=4 * P, recent_tokens=P, share_layers=2, dense_layers=0))
    q = case.q[0][-1:]
    case.store.write(0, plan, case.k[0][-1:], case.v[0][-1:])
    first = sparse.select(case.store, 0, plan, q)
    chosen = first.table.clone()
    second = sparse.select(case.store, 1, plan, q * -1)  # other queries: still the shared selection
    assert second is first and torch.equal(second.table, chosen) and sparse.selections == 1
    third = sparse.select(case.store, 0, plan, q * -1)  # the next group of layers selects anew
    # (a step's selections share their outputs, rewritten by each layer that selects)
    anew = select_for_decode(case.store, 0, plan, q * -1, sparse.cfg)
    assert sparse.selections == 2 and torch.equal(third.table, anew.table) and not torch.equal(anew.table, chosen)
    assert sparse.pages_resident == 3 * 16 and sparse.pages_read == 3 * 4


def test_refusals():
    cfg = make_cfg(partition_size=P)
    case = Case(cfg, lens=[5 * P], seed=1)
    case.extend([5 * P - 1])
    plan = case.store.plan(case.table, case.rows, [5 * P])
    q, k, v = case.q[0][-1:], case.k[0][-1:], case.v[0][-1:]
    sp = SparseConfig(budget_tokens=2 * P, dense_layers=0)
    with pytest.raises(ValueError, match="sliding window"):
        decode(case.store, 0, plan, q, k, v, window=40, sparse=sp)
    with pytest.raises(ValueError, match="'hack' mode"):
        decode(case.store, 0, plan, q, k, v, mode="dequant", sparse=sp)
    with pytest.raises(ValueError, match="non-negative"):
        SparseConfig(budget_tokens=-1)
    with pytest.raises(ValueError, match="share_layers"):
        SparseConfig(budget_tokens=64, share_layers=0)
    with pytest.raises(ValueError, match="refine"):
        SparseConfig(budget_tokens=64, refine=0)
    token = Case(make_cfg(partition_size=P, orientation="token_k"), lens=[5 * P], seed=1)
    token.extend([5 * P - 1])
    with pytest.raises(ValueError, match="channel_k"):
        select_for_decode(token.store, 0, token.store.plan(token.table, token.rows, [5 * P]), q, sp)
    assert ROUNDOFF_TOL < FLIP_TOL


# (head_dim, query heads per KV head): the kernel's register paths (64, 128) and its general
# one (96), at the GQA ratios of the served shapes (SmolLM2 3, Llama-3 4) and MHA
GEOMETRIES = [(64, 3), (128, 4), (96, 1)]


@pytest.mark.parametrize("score", ["bound", "linear"])
@pytest.mark.parametrize("kw", [dict(sink_tokens=4), dict(sink_tokens=0, k_bits=4)],
                         ids=lambda kw: make_cfg(partition_size=P, **kw).label())
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"d{g[0]}-rep{g[1]}")
def test_compiled_selection_equals_the_reference(kw, score, geometry):
    """hack_select.c: the page scores equal hack_ops.sparse.page_scores on the gathered side
    tables (float32 round-off), and the whole selection (scores, top-k, the per-head table)
    equals the PyTorch path's, page for page; twice on one plan (the second reads the
    selection inputs the first left in plan.memo)."""
    _need_kernel("native")
    from hack_ops.paged.sparse import _as_table, closed_page_meta, kernel_scores, kernel_select

    d, rep = geometry
    case, plan, q = _decode_step(make_cfg(partition_size=P, **kw), d, rep, seed=11)
    mn, sc, n_closed = closed_page_meta(case.store, 0, plan)
    bits = case.store.layout_for(0).k.bits
    want = page_scores(q.reshape(4, 2, rep, -1), mn, sc, bits, score)
    got = kernel_scores(case.store, 0, plan, q, score)
    for b, nc in enumerate(n_closed.tolist()):
        assert torch.allclose(got[b, :, :nc], want[b, :, :nc], rtol=1e-5, atol=1e-4)
        assert bool(torch.isinf(got[b, :, nc:]).all())
    sparse = SparseConfig(budget_tokens=6 * P, recent_tokens=2 * P, score=score)
    idx, count = select(q.reshape(4, 2, rep, -1), mn, sc, bits, n_closed, sparse, P)
    torch_path = _as_table(plan, idx, count, n_closed, P)
    for _ in range(2):
        compiled = kernel_select(case.store, 0, plan, q, sparse)
        for name in ("positions", "table", "n_closed", "seq_lens", "resident"):
            assert torch.equal(getattr(compiled, name), getattr(torch_path, name)), name


@pytest.mark.parametrize("score", ["bound", "linear"])
@pytest.mark.parametrize("kw", [dict(sink_tokens=4), dict(sink_tokens=0, k_bits=4)],
                         ids=lambda kw: make_cfg(partition_size=P, **kw).label())
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"d{g[0]}-rep{g[1]}")
@pytest.mark.parametrize("groups", [2, 3])
def test_compiled_two_level_selection_from_cached_boxes_equals_the_reference(groups, geometry, kw, score):
    """hack_select.c's two levels, from the cached group boxes (hack_ops.paged.group_boxes):
    the same per-head page table as the PyTorch path's hack_ops.sparse.select with
    group_pages, which recomputes every box; and again on the next step from the boxes kept.
    Groups of 2 and 3 pages over requests of 3 to 20 closed pages: some groups dropped, the
    recent pages' group kept whatever its score."""
    _need_kernel("native")
    from hack_ops.paged.group_boxes import GroupBoxCache
    from hack_ops.paged.sparse import _as_table, closed_page_meta, kernel_select

    d, rep = geometry
    case, plan, q = _decode_step(make_cfg(partition_size=P, **kw), d, rep, seed=12)
    mn, sc, n_closed = closed_page_meta(case.store, 0, plan)
    bits = case.store.layout_for(0).k.bits
    sparse = SparseConfig(budget_tokens=6 * P, recent_tokens=2 * P, score=score, group_pages=groups, group_keep=1.0)
    idx, count = select(q.reshape(4, 2, rep, -1), mn, sc, bits, n_closed, sparse, P)
    torch_path = _as_table(plan, idx, count, n_closed, P)
    assert sparse.keep_groups(P) < -(-int(n_closed.max()) // groups)  # groups are dropped: both levels act
    cache = GroupBoxCache(groups)
    assert kernel_select(case.store, 0, plan, q, sparse) is None  # two levels read cached boxes only
    for step in range(2):
        cache.begin(plan, ["a", "b", "c", "d"])
        compiled = kernel_select(case.store, 0, plan, q, sparse, cache)
        for name in ("positions", "table", "n_closed", "seq_lens", "resident"):
            assert torch.equal(getattr(compiled, name), getattr(torch_path, name)), (step, name)
        # request i's middle groups: those before its recent pages' first group
        assert cache.computed == sum(max(0, (nc - 2) // groups) for nc in n_closed.tolist())
    sel = SparseDecode(sparse, boxes=cache, keys=["a", "b", "c", "d"]).select(case.store, 0, plan, q)
    assert torch.equal(sel.table, torch_path.table)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_selection_reads_the_model_dtype_as_float(dtype):
    """Queries in the model's dtype go to hack_select.c as they are (converted there, exactly):
    the same scores and the same selection as the float32 queries of the same values."""
    _need_kernel("native")
    from hack_ops.paged.sparse import kernel_scores, kernel_select

    case, plan, q = _decode_step(make_cfg(partition_size=P), 64, 3, seed=17)
    q = q.to(dtype)
    sparse = SparseConfig(budget_tokens=6 * P, recent_tokens=2 * P, refine=2)
    assert torch.equal(kernel_scores(case.store, 0, plan, q), kernel_scores(case.store, 0, plan, q.float()))
    got, want = kernel_select(case.store, 0, plan, q, sparse), kernel_select(case.store, 0, plan, q.float(), sparse)
    for name in ("positions", "table", "n_closed", "seq_lens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    strided = q.float().transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous: converted in torch
    assert torch.equal(kernel_select(case.store, 0, plan, strided, sparse).table, want.table)


def test_group_box_cache_starts_over_where_the_pages_changed():
    """An entry whose request now holds other pages at the cached positions is computed anew; a
    request absent from a forward loses its entry; keys must match the requests."""
    _need_kernel("native")
    from hack_ops.paged.group_boxes import GroupBoxCache
    from hack_ops.paged.sparse import _as_table, closed_page_meta, kernel_select

    case, plan, q = _decode_step(make_cfg(partition_size=P), 64, 3, seed=13)
    sparse = SparseConfig(budget_tokens=6 * P, recent_tokens=2 * P, group_pages=3, group_keep=1.0)
    cache = GroupBoxCache(3)
    cache.begin(plan, ["a", "b", "c", "d"])
    first = kernel_select(case.store, 0, plan, q, sparse, cache)
    assert len(cache) == 3  # request c (3 closed pages) has no middle group
    # the same requests, request a's pages 3..5 swapped for request d's (other keys there)
    table = plan.page_table.clone()
    table[0, 3:6] = plan.page_table[3, 3:6]
    moved = dataclasses.replace(plan, page_table=table)
    before = cache.computed
    cache.begin(moved, ["a", "b", "c", "d"])
    again = kernel_select(case.store, 0, moved, q, sparse, cache)
    assert cache.computed - before == max(0, (int(moved.seq_lens[0]) // P - 2) // 3)  # a's boxes only
    mn, sc, n_closed = closed_page_meta(case.store, 0, moved)
    idx, count = select(q.reshape(4, 2, 3, -1), mn, sc, 2, n_closed, sparse, P)
    want = _as_table(moved, idx, count, n_closed, P)
    assert torch.equal(again.table, want.table) and torch.equal(first.table[1:], again.table[1:])
    cache.begin(plan, ["x", "b", "c", "y"])
    assert len(cache) == 1  # only b is still running
    cache.forget([int(plan.rows[1])], ["b"])  # an extend forward for b: its boxes start over
    assert len(cache) == 0
    with pytest.raises(ValueError, match="request keys"):
        cache.begin(moved, ["a"])


def test_sparse_methods_of_the_served_benchmarks():
    from hack_cli.server_methods import is_method, method_args, sparse_budget

    assert sparse_budget("hack-sparse-2048") == 2048 and sparse_budget("hack-sparse-x") is None
    assert not is_method("hack-sparse-0") and is_method("hack-sparse-1024") and is_method("hack")
    bound = ["--hack-sparse-score", "bound"]  # a method without -linear/-auto names the bound, as it always did
    assert method_args("hack-sparse-1024", None) == ["--kv-cache-dtype", "hack", "--hack-sparse-budget", "1024", *bound]
    assert method_args("hack-sparse-1024-share2", None)[-4:] == ["--hack-sparse-share-layers", "2", *bound]
    assert sparse_budget("hack-sparse-1024-share2") == 1024 and method_args("hack-sparse-512-share1", None)[-3] == "512"
    assert method_args("hack-sparse-1024-share2-linear", None)[-4:] == [
        "--hack-sparse-share-layers", "2", "--hack-sparse-score", "linear"]
    assert method_args("hack-sparse-1024-linear", None)[-2:] == ["--hack-sparse-score", "linear"]
    assert method_args("hack-sparse-1024-refine2", None)[-4:] == ["--hack-sparse-refine", "2", *bound]
    assert method_args("hack-sparse-1024-share2-refine4-linear", None)[-6:] == [
        "--hack-sparse-share-layers", "2", "--hack-sparse-refine", "4", "--hack-sparse-score", "linear"]
    assert method_args("hack-sparse-1024-refine1", None)[-3] == "1024"
    assert method_args("hack-sparse-2048-refine2-groups8", None)[-6:] == [
        "--hack-sparse-refine", "2", "--hack-sparse-groups", "8", *bound]
    assert method_args("hack-sparse-2048-groups8-linear", None)[-4:] == [
        "--hack-sparse-groups", "8", "--hack-sparse-score", "linear"]
    # -auto: no score given, the server chooses for the model (engine.sparse_choice)
    assert method_args("hack-sparse-2048-auto", None) == ["--kv-cache-dtype", "hack", "--hack-sparse-budget", "2048"]
    assert method_args("hack-sparse-2048-refine4-auto", None)[-2:] == ["--hack-sparse-refine", "4"]
    for bad in ("hack-sparse", "hack-sparse-1024-share0", "hack-sparse-1024-share", "hack-sparse-1024-sharex",
                "hack-sparse-1024-linear-share2", "hack-sparse-1024-x", "hack-sparse-1024-",
                "hack-sparse-1024-refine0", "hack-sparse-1024-refine", "hack-sparse-1024-refine2-share2",
                "hack-sparse-1024-groups0", "hack-sparse-1024-groups8-refine2", "hack-sparse-1024-auto-linear",
                "hack-sparse-1024-linear-auto", "hack-sparse-1024-auto-share2"):
        assert not is_method(bad)
        with pytest.raises(ValueError, match="unknown KV method"):
            method_args(bad, None)


@pytest.mark.parametrize("refine", [1, 2])
@pytest.mark.parametrize("mode", ["hack", "dequant"])
def test_reference_sparse_attention_is_each_row_a_sparse_decode_step(mode, refine):
    """hack_ops.attention(..., sparse=): a teacher-forced pass where every row reads only the
    pages its own selection keeps. Its last row equals the paged sparse decode step, and a row
    under the budget equals dense attention."""
    from hack_ops.attention import k_page_tables

    cfg = make_cfg(partition_size=P, sink_tokens=4)
    sp = SparseConfig(budget_tokens=5 * P, recent_tokens=P, dense_layers=0, refine=refine)
    n = 17 * P + 9
    case = Case(cfg, lens=[n], heads=2, rep=3, seed=13)
    case.extend([n - 1])
    sparse = SparseDecode(sp)
    out = case.decode(backend="torch", sparse=sparse)[0] if mode == "hack" else None
    t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    ref = attention(t(case.q[0]), t(case.k[0]), t(case.v[0]), cfg, mode=mode, sparse=sp)[0].transpose(0, 1)
    dense = attention(t(case.q[0]), t(case.k[0]), t(case.v[0]), cfg, mode=mode)[0].transpose(0, 1)
    if out is not None:
        assert float((ref[-1] - out).abs().max()) <= FLIP_TOL
    assert torch.equal(ref[:6 * P - 1], dense[:6 * P - 1])  # rows with at most 5 closed pages read all
    assert float((ref[-1] - dense[-1]).abs().max()) > 10 * FLIP_TOL  # and the last one did not
    mn, sc = k_page_tables(t(case.k[0]), cfg)
    assert mn.shape == (1, 2, 17, 64) and bool((sc >= 0).all())


@pytest.mark.parametrize("refine", [1, 3])
def test_study_fast_dequant_path_with_sparse_equals_the_reference(refine):
    """hack_eval's blocked 'dequant' path, where the study measures sparse decode's perplexity at
    long contexts, selects and masks as the reference does (float round-off), across blocks."""
    from hack_eval.attention_paths import QUERY_BLOCK, study_attention

    cfg = make_cfg(partition_size=P, sink_tokens=4)
    g = torch.Generator().manual_seed(17)
    n, d = QUERY_BLOCK + 5 * P + 3, 64
    q = torch.randn(1, 6, n, d, generator=g).half().float()
    k = (torch.randn(1, 2, n, d, generator=g) * (1 + torch.arange(d) % 5)).half().float()
    v = torch.randn(1, 2, n, d, generator=g).half().float()
    sp = SparseConfig(budget_tokens=3 * P, recent_tokens=P, dense_layers=0, refine=refine)
    fast = study_attention(q, k, v, cfg, "dequant", sparse=sp)
    ref = attention(q, k, v, cfg, mode="dequant", sparse=sp)
    assert float((fast - ref).abs().max()) <= 1e-4
    dense = attention(q, k, v, cfg, mode="dequant")
    assert float((fast - dense).abs().max()) > 1e-2  # the selection did drop pages
    with pytest.raises(ValueError, match="sparse decode"):
        study_attention(q, k, v, cfg, "dequant", sparse=sp, window=40)


def test_sparse_benchmark_cell_with_two_levels():
    """`hack bench sparse --groups 8` times the two levels from the boxes a server keeps: a cell
    reports each budget's speed-up, its selection's share and the pages read."""
    _need_kernel("native")
    from hack_cli.bench_sparse import measure

    r = measure("smollm2", 1, 8192, [1024], "bound", 8, 1)
    assert set(r["ms"]) == {"dense", "bf16", "sparse-1024", "select-1024"}
    assert 0.05 < r["pages_read_fraction"][1024] < 0.2  # 16 of 128 pages: not timed, counted
    assert r["selection_share"][1024] > 0 and r["speedup"][1024] > 0  # times are the benchmark's to judge


def test_sparse_benchmark_cell_with_one_level_times_the_step_s_first_layer_too():
    """One level: the selection from the copies, at a later layer (prepared) and at the step's
    first (preparing), and reading the side tables in the pages."""
    _need_kernel("native")
    from hack_cli.bench_sparse import measure

    r = measure("smollm2", 1, 4096, [1024], "bound", 0, 1)
    assert set(r["ms"]) == {"dense", "bf16", "sparse-1024", "select-1024", "select-1024-first",
                            "select-1024-in-pages"}
    assert 0.2 < r["pages_read_fraction"][1024] < 0.3  # 16 of 64 pages


def test_sparse_benchmark_starts_every_timed_call_from_cold_caches():
    """`hack bench sparse --cache cold` (the default): the flush runs before every timed call of
    every method, outside its timing; it writes a buffer larger than the hosts' last-level cache."""
    from hack_cli import bench_sparse

    calls: list[str] = []
    fns = {m: (lambda m=m: calls.append(m)) for m in ("dense", "sparse-1024")}
    ms = bench_sparse._medians(fns, 3, flush=lambda: calls.append("flush"))
    assert calls[:2] == ["dense", "sparse-1024"]  # the warm-up, not flushed
    assert calls[2:] == ["flush", "dense", "flush", "sparse-1024"] * 3 and set(ms) == set(fns)
    assert bench_sparse.FLUSH_BYTES >= 64 << 20
    flush = bench_sparse.cache_flusher()
    assert int(flush()[0]) != int(flush()[0])  # each flush writes anew
