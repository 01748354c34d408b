"""The tiled extend kernel (csrc/hack_extend.c) with sliding windows and logit soft-capping,
against the dense reference hack_ops.attention (mode 'hack', decode-time visibility), in both
builds (AVX-512 VNNI and plain C).

Tolerances are test_paged_attention's, argued there and in test_cpu_extend_kernel: every row
within FLIP_TOL (one INT8 code of Q' or P' flipped by a different summation order), 90% of rows
within round-off. A window or a cap adds no quantization step: the window only masks keys (a
masked key gets a zero numerator, so it takes no part in P''s range), and the cap is a float
function of each score before the softmax (the kernel's tanh, built from its exp, differs from
torch's by ~1e-7 relative), so the same bounds hold.

Windows with Π = 32: smaller than a page (13), a page of keys (31: window+1 = Π), equal to the
page (32), not aligned (45), two pages (64); prefixes 0 (cold), aligned and unaligned.
"""
from __future__ import annotations

import pytest
import torch

from hack_ops.paged import cpu_extend, cpu_kernel
from hack_ops.paged.attention import _fp16_windows
from hack_ops.paged.torch_attention import first_page
from test_cpu_extend_kernel import assert_extend_paths_agree
from test_paged_attention import FLIP_TOL, ROUNDOFF_TOL, Case, make_cfg

P = 32
TILED = cpu_extend.TILED


@pytest.fixture(autouse=True)
def _need_kernel():
    for v in ("native", "portable"):
        if cpu_extend._lib(v) is None:
            pytest.skip(f"the CPU kernel could not be built here: {cpu_kernel._errors.get(v)}")


@pytest.fixture(params=["tiled", "portable"])
def variant(request, monkeypatch):
    """The build the tiled kernel runs from: -march=native, or the plain-C loops."""
    if request.param == "portable":
        monkeypatch.setenv("HACK_EXTEND_KERNEL", "portable")
    else:
        monkeypatch.delenv("HACK_EXTEND_KERNEL", raising=False)
    return request.param


def _tiled(case: Case) -> None:
    path, why = cpu_extend.choose(case.store, "hack", window=case.feat["window"], logit_cap=case.feat["logit_cap"])
    assert path in TILED, why


@pytest.mark.parametrize("window,cap", [(13, 0.0), (31, 5.0), (32, 0.0), (45, 5.0), (64, 0.0), (None, 5.0)],
                         ids=["w13-smaller", "w31-page-of-keys-cap", "w32-equal", "w45-unaligned-cap",
                              "w64-two-pages", "cap-only"])
def test_windows_and_cap(window, cap, variant):
    """Cold chunks, then chunks over prefixes 20, 3 (unaligned), 64 (aligned) and 45, with
    sinks (which fall out of the window) and GQA."""
    cfg = make_cfg(partition_size=P, sink_tokens=4)
    case = Case(cfg, lens=[150, 45, 130, 100], heads=2, rep=3, seed=31, window=window, logit_cap=cap)
    _tiled(case)
    case.check(case.extend([20, 3, 64, 45], backend="cpu"), "cold chunk")
    case.check(case.extend([150, 45, 130, 100], backend="cpu"), "chunk over a prefix")
    case.finish()


@pytest.mark.parametrize("bits,window,cap", [(2, 100, 0.0), (2, 70, 30.0), (4, 127, 0.0)])
def test_head_dim_256_one_kv_head(bits, window, cap, variant):
    """Gemma-3-like layers: head_dim 256, 4 query heads on one KV head, Π 64, the layer's
    scale (query_pre_attn_scalar ** -0.5), windows unaligned and of exactly two pages of keys."""
    cfg = make_cfg(partition_size=64, kv_bits=bits, sink_tokens=1)
    case = Case(cfg, lens=[300, 160], heads=1, rep=4, head_dim=256, seed=32 + bits, window=window,
                logit_cap=cap, scale=256 ** -0.5)
    _tiled(case)
    case.check(case.extend([128, 75], backend="cpu"), "cold chunk")  # then aligned / unaligned prefixes
    case.check(case.extend([300, 160], backend="cpu"), "chunk over a prefix")
    case.finish()


@pytest.mark.parametrize("prefill", ["homomorphic", "exact"])
def test_paths_agree(prefill, monkeypatch):
    """Tiled, per-query and torch extend over a cached unaligned prefix read the same cache with
    the same window and cap ('exact' too, which has no dense reference over a prefix)."""
    cfg = make_cfg(partition_size=P, sink_tokens=1)
    assert_extend_paths_agree(
        lambda: Case(cfg, lens=[160, 50], seed=33, window=45, logit_cap=4.0, scale=0.2),
        [45, 20], prefill, monkeypatch)


def _written(window: int, seed: int) -> tuple[Case, object]:
    """A request whose prefix is cached and whose chunk (positions 150..199) is written: the
    plan and store the kernel is then called on directly."""
    cfg = make_cfg(partition_size=P, sink_tokens=2)
    case = Case(cfg, lens=[200], heads=1, rep=2, seed=seed, window=window)
    case.extend([150])
    plan = case.store.plan(case.table, [case.rows[0]], [200], [50])
    return case, plan


def _call(case: Case, plan, snaps: dict, **kw) -> torch.Tensor:
    k, v, q = case.k[0][150:], case.v[0][150:], case.q[0][150:]
    kw_, vw, woff = _fp16_windows(case.store, plan, k, v, snaps)
    return cpu_extend.attend(case.store, 0, plan, q, 64 ** -0.5, kw_, vw, woff, False, window=case.feat["window"],
                             **kw)


def test_pages_before_the_window_are_not_read():
    """Pages wholly before the first new token's window (and the sinks on page 0) are not read:
    overwrite their bytes with 0xFF (NaN scales and minima) and the output keeps every bit."""
    from hack_ops.paged.attention import keep_open_tokens

    case, plan = _written(50, seed=34)
    snaps = keep_open_tokens(case.store, 0, plan)
    case.store.write(0, plan, case.k[0][150:], case.v[0][150:])
    case.done[0] = 200
    lo = first_page(150, 50, P)
    assert lo == 3  # key 100 is on page 3: pages 0..2 lie wholly before every window
    before = _call(case, plan, snaps)
    before_portable = _call(case, plan, snaps, variant="portable")
    case.check({0: before}, "before")
    err = (before_portable - before).abs().amax(-1)
    assert float(err.max()) <= FLIP_TOL
    if cpu_extend.tiled_path() == cpu_extend.ExtendPath.AVX2:  # the plain-C operations, in registers
        assert torch.equal(before, before_portable)
    store = case.store
    for pg in plan.page_table[0, :lo].tolist():
        store.k_pages[0][pg] = 255
        store.v_pages[0][pg] = 255
    store.sink_k[0].fill_(float("nan"))
    store.sink_v[0].fill_(float("nan"))
    assert torch.equal(_call(case, plan, snaps), before)
    assert torch.equal(_call(case, plan, snaps, variant="portable"), before_portable)
    # the boundary page 3 is read: poisoning it changes the output
    pg = int(plan.page_table[0, lo])
    store.v_pages[0][pg] = 255
    assert _call(case, plan, snaps).isnan().any()


def test_blocks_and_threads_do_not_change_a_bit():
    """Work split (block size, thread count) with a window: each row is still computed by one
    thread from the same operands in the same order, whatever page its item starts at."""
    from hack_ops.paged.attention import keep_open_tokens

    case, plan = _written(13, seed=35)
    snaps = keep_open_tokens(case.store, 0, plan)
    case.store.write(0, plan, case.k[0][150:], case.v[0][150:])
    base = _call(case, plan, snaps, logit_cap=3.0)
    assert not base.isnan().any()
    for bt in (1, 7, 50):
        assert torch.equal(base, _call(case, plan, snaps, logit_cap=3.0, block_tokens=bt)), bt
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(base, _call(case, plan, snaps, logit_cap=3.0))
    finally:
        torch.set_num_threads(threads)


def test_choose_takes_the_tiled_kernel_for_window_layers(monkeypatch):
    """A window or soft-cap layer now takes the tiled kernel (it used to go per-query)."""
    monkeypatch.delenv("HACK_EXTEND_KERNEL", raising=False)
    case = Case(make_cfg(partition_size=P), lens=[40], seed=36)
    want = cpu_extend.tiled_path()
    for kw in ({"window": 511}, {"window": 16, "logit_cap": 30.0}, {"logit_cap": 50.0}):
        path, why = cpu_extend.choose(case.store, "hack", **kw)
        assert path == want and "tiled" in why, (kw, why)
    for prefill in ("homomorphic", "exact"):
        assert cpu_extend.choose(case.store, "hack", window=511, prefill=prefill)[0] == want
    monkeypatch.setenv("HACK_EXTEND_KERNEL", "per-query")  # the per-query kernel stays selectable
    assert cpu_extend.choose(case.store, "hack", window=511)[0] == cpu_extend.ExtendPath.PER_QUERY
