"""The compiled page store (hack_ops/paged/csrc/hack_store.c) against the PyTorch reference
store (write.py): the same bytes in pages, tails, sinks and sink map, for every option it
claims, over prefill chunks (page-aligned or not), multi-page extends, mixed batches and
decode steps (appends and page-closing ones). Tolerance: none, bytes are compared."""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig
from hack_ops.paged import HackKVStore, cpu_store
from hack_ops.paged.fill import scattered_table
from hack_ops.paged.store import StoreBackend

pytestmark = pytest.mark.skipif(cpu_store.load() is None, reason="no C compiler: the compiled store cannot be built")


def _kv(n: int, h: int, d: int, seed: int, dtype: torch.dtype, grid: bool = False):
    g = torch.Generator().manual_seed(seed)
    if grid:  # halves on a coarse grid: many (x - min) / scale fall exactly on ties
        k = torch.randint(-12, 13, (n, h, d), generator=g).float() * 0.5
        v = torch.randint(-6, 7, (n, h, d), generator=g).float() * 0.25
        return k.to(dtype), v.to(dtype)
    chan = (1 + torch.arange(d) % 7).float()  # uneven channel ranges, like real keys
    k = torch.randn(n, h, d, generator=g) * chan
    v = torch.randn(n, h, d, generator=g)
    k[n // 3, 0, :4] = 0.0  # exact zeros: the sign of a zero minimum must not matter
    return k.to(dtype), v.to(dtype)


def _assert_same(ref: HackKVStore, mine: HackKVStore) -> None:
    for name in ("k_pages", "v_pages", "sink_k", "sink_v"):
        for layer, (a, b) in enumerate(zip(getattr(ref, name), getattr(mine, name))):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name}[{layer}] differs"
    for name in ref.tails:
        for a, b in zip(ref.tails[name], mine.tails[name]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"tail {name} differs"
    assert torch.equal(ref.sink_map, mine.sink_map)


def run_schedule(cfg: HackConfig, heads: int, d: int, schedule: list[list[int]], dtype=torch.bfloat16,
                 seed: int = 0, grid: bool = False) -> tuple[HackKVStore, HackKVStore]:
    """Write the same tokens with the reference store and the compiled one (schedule[step][i]
    new tokens for request i, 0 = idle) and compare every byte after every step."""
    p = cfg.partition_size
    rows = [3, 1, 0][: len(schedule[0])]
    totals = [sum(s[i] for s in schedule) for i in range(len(rows))]
    pages = sum(-(-n // p) for n in totals) + 3
    stores = [HackKVStore(cfg, 1, heads, d, num_pages=pages, num_rows=4) for _ in range(2)]
    table = scattered_table(totals, p, 4, rows, pages, generator=torch.Generator().manual_seed(seed))
    kv = [_kv(n, heads, d, seed + i, dtype, grid) for i, n in enumerate(totals)]
    done = [0] * len(rows)
    for step in schedule:
        act = [i for i, n in enumerate(step) if n]
        lens = [done[i] + step[i] for i in act]
        k = torch.cat([kv[i][0][done[i]:done[i] + step[i]] for i in act])
        v = torch.cat([kv[i][1][done[i]:done[i] + step[i]] for i in act])
        for store, backend in zip(stores, (StoreBackend.TORCH, StoreBackend.CPU)):
            plan = store.plan(table, [rows[i] for i in act], lens, [step[i] for i in act])
            store.write(0, plan, k, v, backend=backend)
        _assert_same(*stores)
        for i in act:
            done[i] += step[i]
    return stores[0], stores[1]


def _schedule(p: int) -> list[list[int]]:
    # an unaligned prefill chunk, one that closes the open page and spans pages, decode steps
    # (appends and page-closing ones), an idle request, a chunk that ends on a page boundary
    return [[p + 5, 3], [2 * p + 7, p - 4], [1, 1], [p - 13, 1], [1, 2], [0, 1], [p, 2 * p - 3]]


@pytest.mark.parametrize("page,heads,d,kw", [
    (64, 3, 64, {}),  # the default format, SmolLM2's KV heads
    (32, 2, 64, {"sink_tokens": 4}),
    (32, 1, 128, {"kv_bits": 4, "meta_dtype": "float32", "sink_tokens": 0}),
    (64, 8, 128, {"range_search": False}),
    (128, 2, 128, {"sink_tokens": 3, "kv_bits": 4}),
    (32, 2, 256, {"tail_tensors": "per_channel", "sink_tokens": 2}),
    (64, 3, 64, {"tail_tensors": "per_channel", "range_search": False, "meta_dtype": "float32"}),
    (128, 1, 256, {"meta_dtype": "float32", "sink_tokens": 128}),  # a page of sinks only
    (64, 2, 128, {"k_bits": 4}),  # K at 4 bits, V at 2
    (32, 1, 64, {"kv_bits": 4, "k_bits": 2, "tail_tensors": "per_channel", "sink_tokens": 2}),
])
def test_bytes_equal_the_reference_store(page, heads, d, kw):
    cfg = HackConfig(partition_size=page, **kw)
    run_schedule(cfg, heads, d, _schedule(page))


@pytest.mark.parametrize("kw", [{}, {"range_search": False}, {"kv_bits": 4, "meta_dtype": "float32"},
                                {"tail_tensors": "per_channel"}])
def test_exact_ties_round_as_the_reference(kw):
    """Values on a coarse grid put many quotients (x - min) / scale exactly on a half: the
    compiled store rounds them by multiplying with 1/scale and redoes a row with the division
    where the product lies near a half, so ties must still round as the reference's division."""
    for dtype in (torch.bfloat16, torch.float32):
        run_schedule(HackConfig(partition_size=32, **kw), 2, 64, _schedule(32), dtype=dtype, seed=5, grid=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_input_dtypes(dtype):
    """fp16 / fp32 input (bf16 is the default above); without a V tail V is quantized from the
    input precision, so fp32 exercises that path's exact arithmetic too."""
    for tails in ("kv", "per_channel"):
        run_schedule(HackConfig(partition_size=32, tail_tensors=tails), 2, 64, _schedule(32), dtype=dtype)


def test_threads_do_not_change_bytes():
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a, _ = run_schedule(HackConfig(partition_size=32), 2, 64, [[200, 70]], seed=3)
        torch.set_num_threads(2)
        _, b = run_schedule(HackConfig(partition_size=32), 2, 64, [[200, 70]], seed=3)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(a.k_pages[0], b.k_pages[0]) and torch.equal(a.v_pages[0], b.v_pages[0])


def test_auto_uses_it_and_falls_back_with_a_reason():
    store = HackKVStore(HackConfig(partition_size=32), 1, 2, 64, num_pages=8, num_rows=2)
    assert cpu_store.why_not(store) is None
    for cfg, needle in ((HackConfig(orientation="token_k"), "token_k"),
                        (HackConfig(rounding="stochastic"), "stochastic"),
                        (HackConfig(requant_elimination=False), "requant_elimination")):
        assert needle in cpu_store.why_not(HackKVStore(cfg, 1, 2, 64, num_pages=4, num_rows=1))
    assert "head_dim" in cpu_store.why_not(HackKVStore(HackConfig(partition_size=32), 1, 2, 96, num_pages=4, num_rows=1))
    odd = HackKVStore(HackConfig(orientation="token_k", partition_size=32), 1, 2, 64, num_pages=4, num_rows=1)
    plan = odd.plan(scattered_table([40], 32, 1, [0], 4), [0], [40], [40])
    with pytest.raises(RuntimeError, match="token_k"):
        odd.write(0, plan, *_kv(40, 2, 64, 0, torch.bfloat16), backend="cpu")
    odd.write(0, plan, *_kv(40, 2, 64, 0, torch.bfloat16))  # auto: the PyTorch store


def test_bad_input_writes_nothing():
    store = HackKVStore(HackConfig(partition_size=32), 1, 2, 64, num_pages=8, num_rows=2)
    plan = store.plan(scattered_table([70], 32, 2, [0], 8), [0], [70], [70])
    k, v = _kv(70, 2, 64, 0, torch.bfloat16)
    k[69, 1, 5] = float("nan")
    before = [t.clone() for t in (store.k_pages[0], store.v_pages[0], store.tails["k"][0], store.sink_k[0])]
    with pytest.raises(ValueError, match="NaN"):
        store.write(0, plan, k, v, backend="cpu")
    after = (store.k_pages[0], store.v_pages[0], store.tails["k"][0], store.sink_k[0])
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_summation_orders_match_torch():
    """The range search's error sums: the C orders equal torch's sum for both layouts."""
    width = cpu_store.summation_order()
    assert width is not None
    g = torch.Generator().manual_seed(7)
    x = cpu_store._spread((64, 3, 64), g)  # K: [Π, H, D] summed over Π
    assert torch.equal(cpu_store.c_sum(x.reshape(64, -1), cpu_store.SUM_ROWS), x.movedim(0, -1).sum(-1).reshape(-1))
    y = cpu_store._spread((100, 64), g)  # V: groups along the contiguous head_dim
    assert torch.equal(cpu_store.c_sum(y.t(), cpu_store.SUM_INNER, width), y.sum(-1))


def test_portable_build_writes_the_same_bytes():
    """The variant without -march=native (no AVX-512, no F16C: software fp16 conversions)."""
    if cpu_store.load("portable") is None or cpu_store.summation_order("portable") is None:
        pytest.skip("the portable variant cannot be built here")
    cfg = HackConfig(partition_size=32, sink_tokens=2)
    p = 32
    stores = [HackKVStore(cfg, 1, 2, 64, num_pages=12, num_rows=2) for _ in range(2)]
    table = scattered_table([3 * p + 9], p, 2, [1], 12, generator=torch.Generator().manual_seed(4))
    k, v = _kv(3 * p + 9, 2, 64, 4, torch.bfloat16)
    k[p:2 * p], v[p:2 * p] = _kv(p, 2, 64, 4, torch.bfloat16, grid=True)  # ties too
    done = 0
    for n in (p + 3, 2 * p, 1, 5):
        for store, variant in zip(stores, (None, "portable")):
            plan = store.plan(table, [1], [done + n], [n])
            if variant is None:
                store.write(0, plan, k[done:done + n], v[done:done + n], backend="torch")
            else:
                cpu_store.write(store, 0, plan, k[done:done + n], v[done:done + n], variant=variant)
        done += n
    _assert_same(*stores)
