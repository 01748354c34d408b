"""Static eviction on the paged store (hack_ops.paged.static_keep, `--hack-static-keep`).

What must hold: the kept set a server decides from a prompt chunk's last queries is the
reference's (hack_ops.static_keep.keep_mask) over the keys as the pages hold them, whether the
prompt came in one chunk or several; a page the window's queries look at is kept; a decode step
over the kept pages is the dense reference run on the shorter sequence of those pages, then
every page closed since the prompt and the open partition, on the compiled kernel and the
PyTorch path; a row whose set was not decided, or that drops nothing, reads every page.
"""
from __future__ import annotations

import pytest
import torch

from hack_ops.paged import extend
from hack_ops.paged.dequant import dense_kv
from hack_ops.paged.sparse import SparseTotals
from hack_ops.paged.static_keep import StaticKeepPages
from hack_ops.static_keep import KeepUnit, StaticKeep, keep_mask
from test_paged_attention import FLIP_TOL, Case, _need_kernel, make_cfg
from test_sparse_decode import _sparse_reference

P = 32
SCALE = 64 ** -0.5  # Case's head_dim 64, the default scale


def _prefill(case: Case, keeper: StaticKeepPages, upto: list[int], layer: int = 0):
    """One extend forward to lengths `upto` as the backend runs it: begin_extend, the layer's
    store and attention, then observe with the forward's queries."""
    act = [i for i in range(len(case.lens)) if upto[i] > case.done[i]]
    ext = [upto[i] - case.done[i] for i in act]
    plan = case.store.plan(case.table, [case.rows[i] for i in act], [upto[i] for i in act], ext)
    keeper.begin_extend(plan)
    cat = lambda xs: torch.cat([xs[i][case.done[i]:upto[i]] for i in act])  # noqa: E731
    q = cat(case.q)
    extend(case.store, layer, plan, q, cat(case.k), cat(case.v), mode="hack")
    keeper.observe(case.store, layer, plan, q, SCALE)
    for i in act:
        case.done[i] = upto[i]
    return plan


def _reference_kept(case: Case, i: int, n: int, cfg: StaticKeep, layer: int = 0) -> torch.Tensor:
    """keep_mask over request i's first n positions, keys as its pages hold them."""
    plan = case.store.plan(case.table, [case.rows[i]], [n], [1])  # only its page table and sink slot are read
    tails = {name: t[layer][case.rows[i]] for name, t in case.store.tails.items()}
    k = dense_kv(case.store, layer, plan, 0, n, tails, torch.float32, names=("k",))["k"]
    h = k.shape[0]
    q = case.q[i][:n].reshape(n, h, -1, k.shape[-1]).permute(1, 2, 0, 3)
    return keep_mask(q, k, n, P, cfg, SCALE)


@pytest.mark.parametrize("unit", list(KeepUnit))
def test_kept_set_is_the_reference_in_one_chunk_or_several(unit):
    cfg = StaticKeep(keep=0.4, observe=0.05, unit=unit)
    lens = [20 * P + 7, 9 * P, 40]
    chunked = {}
    for way in ("one", "chunks"):
        case = Case(make_cfg(partition_size=P, sink_tokens=4), lens=lens, heads=2, rep=3, seed=3)
        keeper = StaticKeepPages(cfg)
        if way == "chunks":  # the first chunk's set is replaced by the last chunk's
            _prefill(case, keeper, [5 * P + 3, 4 * P, 10])
            assert keeper.kept(case.rows[0]).prompt_pages == 5
        _prefill(case, keeper, lens)
        for i, n in enumerate(lens):
            got = keeper.kept(case.rows[i])
            if n < P:  # no closed page: nothing to decide
                assert got is None
                continue
            want = _reference_kept(case, i, n, cfg)  # [H, N]
            assert got.prompt_pages == n // P
            assert torch.equal(got.positions[0], want.nonzero()[:, 1].reshape(2, -1)), (way, i)
            assert got.positions[0].shape[1] == (8, 4, 1)[i]  # ceil(0.4 * 20), ceil(0.4 * 9), the first page
            if unit == KeepUnit.PAGE:
                assert torch.equal(got.positions[0][0], got.positions[0][1])
            chunked.setdefault(i, []).append(got.positions[0])
    assert all(torch.equal(a, b) for a, b in chunked.values())


def test_the_page_the_window_looks_at_is_kept():
    """Keys of one page point where the window's queries point: that page is kept in every head,
    whatever its place, at a keep that drops most pages."""
    lens = [24 * P]
    case = Case(make_cfg(partition_size=P, sink_tokens=4), lens=lens, heads=2, rep=2, seed=4)
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(64, generator=g)
    direction = direction / direction.norm() * 6
    m = StaticKeep(keep=0.25, observe=0.05).observe_rows(lens[0])
    for needle in (3, 11):
        case = Case(make_cfg(partition_size=P, sink_tokens=4), lens=lens, heads=2, rep=2, seed=4)
        case.k[0][needle * P:(needle + 1) * P] += direction.half().float()
        case.q[0][-m:] += direction.half().float()
        keeper = StaticKeepPages(StaticKeep(keep=0.25, observe=0.05, unit=KeepUnit.HEAD))
        _prefill(case, keeper, lens)
        pos = keeper.kept(case.rows[0]).positions[0]
        assert pos.shape == (2, 6)
        assert all(needle in pos[h].tolist() and 0 in pos[h].tolist() for h in range(2)), (needle, pos)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_decode_reads_the_kept_pages_then_every_page_closed_since(backend):
    if backend == "cpu":
        _need_kernel("native")
    cfg = make_cfg(partition_size=P, sink_tokens=4)
    lens = [20 * P + 7, 9 * P, 3 * P + 1]
    prompt = [n - 40 for n in lens]  # 40 decode steps: a page closes after each prompt
    case = Case(cfg, lens=lens, heads=2, rep=3, seed=5)
    totals = SparseTotals()
    keeper = StaticKeepPages(StaticKeep(keep=0.5, observe=0.02, unit=KeepUnit.HEAD), totals)
    _prefill(case, keeper, prompt)
    kept = {i: keeper.kept(case.rows[i]).positions[0].clone() for i in range(3)}
    for _ in range(39):
        case.decode(backend=backend, sparse=keeper)
    plan = case.store.plan(case.table, case.rows, [n + 1 for n in case.done])
    sel = keeper.select(case.store, 0, plan)
    outs = case.decode(backend=backend, sparse=keeper)
    for i, n in enumerate(lens):
        nc, first_after = n // P, prompt[i] // P
        c = int(sel.n_closed[i])
        assert c == kept[i].shape[1] + nc - first_after
        for h in range(2):
            assert sel.positions[i, h, :c].tolist() == kept[i][h].tolist() + list(range(first_after, nc))
        ref = _sparse_reference(case, i, sel.positions[i], c)
        assert float((outs[i] - ref).abs().max()) <= FLIP_TOL, i
    assert [kept[i].shape[1] for i in range(3)] == [9, 4, 1]  # ceil(0.5 x 18, 7, 1 prompt pages)
    assert totals.steps == 41 and totals.layer_steps == 41 and 0 < totals.pages_read < totals.pages_resident


def test_rows_without_a_kept_set_read_every_page():
    cfg = make_cfg(partition_size=P, sink_tokens=4)
    lens = [12 * P + 5, 6 * P + 2]
    case = Case(cfg, lens=lens, seed=6)
    keeper = StaticKeepPages(StaticKeep(keep=0.5))
    _prefill(case, keeper, [lens[0] - 1, lens[1] - 1])
    plan = case.store.plan(case.table, case.rows, lens)
    sel = keeper.select(case.store, 0, plan)
    assert sel.n_closed.tolist() == [6, 3]
    assert keeper.select(case.store, 1, plan) is None  # the layer had no prefill here: nothing dropped
    keeper.begin_extend(case.store.plan(case.table, [case.rows[0]], [lens[0]], [1]))  # row 0 prefills anew
    sel = keeper.select(case.store, 0, plan)
    assert sel.n_closed.tolist() == [12, 3] and sel.positions[0, 0, :12].tolist() == list(range(12))
    with pytest.raises(ValueError, match="decode steps"):
        keeper.select(case.store, 0, case.store.plan(case.table, case.rows, lens, [2, 2]))
    with pytest.raises(ValueError, match="off"):
        StaticKeepPages(StaticKeep())


def test_static_methods_of_the_served_benchmarks():
    from hack_cli.server_methods import is_method, method_args, static_keep

    assert static_keep("hack-static-0.5") == 0.5 and static_keep("hack-sparse-1024") is None
    assert method_args("hack-static-0.5", None) == ["--kv-cache-dtype", "hack", "--hack-static-keep", "0.5"]
    assert method_args("hack-static-.25", None)[-1] == "0.25"
    for bad in ("hack-static-", "hack-static-1", "hack-static-0", "hack-static-x", "hack-static-1.5", "hack-static"):
        assert not is_method(bad)
        with pytest.raises(ValueError, match="unknown KV method"):
            method_args(bad, None)
