"""The side tables' copies of the one-level compiled selection (hack_ops.paged.side_copies).

What must hold: scoring from the copies chooses exactly the pages scoring from the pool does
(the same values, another address), for every geometry, side-table dtype, score and refinement;
a page is copied once, when it closes, and a decode step across a page boundary reads the same
pages with and without copies; an entry whose request now holds other pages starts over.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from hack_ops.paged.side_copies import SideTableCopies, copy_bytes, pool_bytes
from hack_ops.paged.sparse import SparseDecode, _as_table, closed_page_meta, kernel_select
from hack_ops.sparse import SparseConfig, select
from test_paged_attention import Case, _need_kernel, make_cfg
from test_sparse_decode import GEOMETRIES, P, _decode_step

KEYS = ["a", "b", "c", "d"]
FIELDS = ("positions", "table", "n_closed", "seq_lens", "resident")


# the refinement scores candidates with the decode kernel, whose heads are 64-channel multiples
CASES = [(g, refine) for g in GEOMETRIES for refine in (1, 2) if refine == 1 or g[0] % 64 == 0]


@pytest.mark.parametrize("score", ["bound", "linear"])
@pytest.mark.parametrize("kw", [dict(sink_tokens=4), dict(sink_tokens=0, k_bits=4), dict(meta_dtype="float32")],
                         ids=lambda kw: make_cfg(partition_size=P, **kw).label())
@pytest.mark.parametrize("geometry,refine", CASES, ids=lambda c: f"d{c[0]}-rep{c[1]}" if isinstance(c, tuple)
                         else f"refine{c}")
def test_selection_from_copies_equals_selection_from_pages(geometry, refine, kw, score):
    _need_kernel("native")
    d, rep = geometry
    case, plan, q = _decode_step(make_cfg(partition_size=P, **kw), d, rep, seed=31)
    sparse = SparseConfig(budget_tokens=6 * P, recent_tokens=2 * P, score=score, refine=refine)
    from_pages = kernel_select(case.store, 0, plan, q, sparse)
    copies = SideTableCopies()
    for step in range(2):  # the second step reads the copies the first one made
        copies.begin(plan, KEYS)
        from_copies = kernel_select(case.store, 0, plan, q, sparse, copies=copies)
        for name in FIELDS:
            assert torch.equal(getattr(from_copies, name), getattr(from_pages, name)), (step, name)
        closed = [int(n) // P for n in plan.seq_lens.tolist()]
        assert copies.copied == sum(closed), step  # each closed page once
    lay = case.store.layout_for(0).k
    assert copy_bytes(case.store, 0) == 2 * 2 * d * (4 if kw.get("meta_dtype") == "float32" else 2)
    assert copies.nbytes >= sum(closed) * copy_bytes(case.store, 0) and lay.per_channel


def test_copies_follow_the_pages_as_they_close():
    """Two identical stores decode across page boundaries, one selecting from copies: every
    step's outputs are equal bit for bit, and each page is copied once, when it closes."""
    _need_kernel("native")
    cfg = make_cfg(partition_size=P, sink_tokens=4)
    lens = [12 * P + 3, 9 * P + 1, 15 * P + 2]
    start = [n - P - 2 for n in lens]  # P + 2 decode steps: every request closes a page
    cases = [Case(cfg, lens=lens, heads=2, rep=3, head_dim=64, seed=5) for _ in range(2)]
    for c in cases:
        c.extend(start, backend="cpu")
    sparse = SparseConfig(budget_tokens=4 * P, recent_tokens=P, dense_layers=0)
    copies = SideTableCopies()
    keys = ["x", "y", "z"]
    for _ in range(P + 2):
        with_copies = cases[0].decode(backend="cpu", sparse=SparseDecode(sparse, copies=copies, keys=keys))
        in_pages = cases[1].decode(backend="cpu", sparse=SparseDecode(sparse, keys=keys))
        for i in with_copies:
            assert torch.equal(with_copies[i], in_pages[i])
    # each closed page copied once: those of the first step, then each as it closed
    closed_first = [(s + 1) // P for s in start]
    closed_last = [n // P for n in lens]
    assert copies.copied == sum(closed_last) and sum(closed_last) == sum(closed_first) + len(lens)
    assert len(copies) == 3


def test_copies_start_over_where_the_pages_changed():
    """An entry whose request now holds other pages at the copied positions is copied anew; a
    request absent from a forward loses its entry; an extend forward forgets its requests."""
    _need_kernel("native")
    case, plan, q = _decode_step(make_cfg(partition_size=P), 64, 3, seed=13)
    sparse = SparseConfig(budget_tokens=6 * P, recent_tokens=2 * P)
    copies = SideTableCopies()
    copies.begin(plan, KEYS)
    first = kernel_select(case.store, 0, plan, q, sparse, copies=copies)
    assert len(copies) == 4
    table = plan.page_table.clone()  # request a's pages 3..5 swapped for request d's
    table[0, 3:6] = plan.page_table[3, 3:6]
    moved = dataclasses.replace(plan, page_table=table)
    before = copies.copied
    copies.begin(moved, KEYS)
    again = kernel_select(case.store, 0, moved, q, sparse, copies=copies)
    assert copies.copied - before == int(moved.seq_lens[0]) // P  # a's pages only, all of them
    mn, sc, n_closed = closed_page_meta(case.store, 0, moved)
    idx, count = select(q.reshape(4, 2, 3, -1), mn, sc, 2, n_closed, sparse, P)
    want = _as_table(moved, idx, count, n_closed, P)
    assert torch.equal(again.table, want.table) and torch.equal(first.table[1:], again.table[1:])
    copies.begin(plan, ["x", "b", "c", "y"])
    assert len(copies) == 2
    copies.forget([int(plan.rows[1])], ["b"])
    assert len(copies) == 1
    with pytest.raises(ValueError, match="request keys"):
        copies.begin(moved, ["a"])


def test_copies_stop_at_their_cap_and_the_rest_read_in_pages():
    """Past max_bytes a request's side tables are read in its pages (counted as refused), and
    the selection is still the same; with no room at all nothing is copied."""
    _need_kernel("native")
    case, plan, q = _decode_step(make_cfg(partition_size=P), 64, 3, seed=19)
    sparse = SparseConfig(budget_tokens=6 * P, recent_tokens=2 * P)
    want = kernel_select(case.store, 0, plan, q, sparse)
    width = copy_bytes(case.store, 0)
    assert pool_bytes(case.store) == case.store.num_pages * sum(
        copy_bytes(case.store, layer) for layer in range(case.store.num_layers))
    closed = [int(n) // P for n in plan.seq_lens.tolist()]  # 20, 9, 3, 14 pages
    for room, copied in ((0, 0), ((closed[0] + 16) * width, 1), (None, 4)):
        copies = SideTableCopies(room)
        copies.begin(plan, KEYS)
        got = kernel_select(case.store, 0, plan, q, sparse, copies=copies)
        for name in FIELDS:
            assert torch.equal(getattr(got, name), getattr(want, name)), (room, name)
        assert sum(1 for e in copies._entries.values() if e.copy is not None and e.copy.rows) == copied, room
        assert copies.refused == 4 - copied and copies.nbytes <= (room if room is not None else copies.nbytes)
    with pytest.raises(ValueError, match="max_bytes"):
        SideTableCopies(-1)


def test_requests_sharing_a_cached_prefix_share_its_copy(monkeypatch):
    """Request b's first 8 of 9 closed pages are request a's (a cached prefix): b reads a's copy
    for them and its last page in place, the selection is the same as from the pages, and the
    prefix is held once. A sharer whose own pages outgrow the share makes its own copy."""
    _need_kernel("native")
    case, plan, q = _decode_step(make_cfg(partition_size=P), 64, 3, seed=23)
    table = plan.page_table.clone()
    table[1, :8] = plan.page_table[0, :8]
    shared = dataclasses.replace(plan, page_table=table)
    sparse = SparseConfig(budget_tokens=4 * P, recent_tokens=P)
    want = kernel_select(case.store, 0, shared, q, sparse)
    copies = SideTableCopies()
    for step in range(2):
        copies.begin(shared, KEYS)
        got = kernel_select(case.store, 0, shared, q, sparse, copies=copies)
        for name in FIELDS:
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)
    assert copies.shared == 1 and copies._entries["b"].copy is copies._entries["a"].copy
    assert copies._entries["b"].limit == 8
    closed = [int(n) // P for n in shared.seq_lens.tolist()]  # 20, 9, 3, 14
    width = copy_bytes(case.store, 0)
    assert copies.copied == closed[0] + closed[2] + closed[3]  # b's 8 shared pages were a's
    assert copies.nbytes == sum(c + 16 for c in (closed[0], closed[2], closed[3])) * width
    # b's own pages past the share grow beyond half of it and GROW_PAGES (2 here, so they fit the
    # table): b copies its own
    import hack_ops.paged.side_copies as side_copies

    monkeypatch.setattr(side_copies, "GROW_PAGES", 2)
    grown = list(closed)
    grown[1] = 8 + 5
    ptrs, held, _ = copies.pointers(case.store, 0, shared, grown)
    assert copies._entries["b"].limit is None and copies._entries["b"].copy is not copies._entries["a"].copy
    assert list(held) == grown and all(ptrs)
