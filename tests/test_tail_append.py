"""The compiled tail append (cpu_store.append_tails): the store step of a decode plan whose tokens
only append to the FP16 tails, against the two torch index writes (write.append_to_tails)."""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig
from hack_ops.paged import HackKVStore, cpu_store
from hack_ops.paged.fill import scattered_table
from hack_ops.paged.write import append_to_tails

pytestmark = pytest.mark.skipif(cpu_store.load() is None, reason="no C compiler: the compiled store cannot be built")

P = 32


def _stores_and_plan(lens: list[int], heads: int = 3, d: int = 64):
    cfg = HackConfig(partition_size=P, sink_tokens=0)  # (a decode plan of cached tokens would need sink slots)
    stores = [HackKVStore(cfg, 2, heads, d, num_pages=40, num_rows=6) for _ in range(2)]
    rows = [4, 1, 0][: len(lens)]
    table = scattered_table(lens, P, 6, rows, 40, generator=torch.Generator().manual_seed(1))
    plans = [s.plan(table, rows, lens, [1] * len(lens)) for s in stores]
    return stores, plans


def _kv(n: int, heads: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, heads, d, generator=g) * 3
    v = torch.randn(n, heads, d, generator=g)
    # values fp16 rounds to subnormals, ties between two fp16 neighbours, and (from wider
    # inputs) finite values it rounds to inf, as torch's conversion does
    k[0, 0, :2] = torch.tensor([3e-6, -2e-7])
    v[-1, -1, :3] = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, -(2 ** -24) * 1.5])
    if dtype != torch.float16:
        k[0, 0, 2:4] = torch.tensor([7e4, -1e5])
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bytes_equal_the_torch_writes(dtype):
    lens = [2 * P + 7, P + 20, 11]  # every token lands inside its open page
    (ref, mine), (pr, pm) = _stores_and_plan(lens)
    assert pm.appends_only
    k, v = _kv(len(lens), 3, 64, dtype)
    append_to_tails(ref, 1, pr, k, v)
    assert cpu_store.append_tails(mine, 1, pm, k, v)
    for name in ("k", "v"):
        for a, b in zip(ref.tails[name], mine.tails[name]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


def test_write_auto_takes_it_and_refuses_non_finite_values_writing_nothing():
    lens = [P + 3, 9]
    (store, _), (plan, _) = _stores_and_plan(lens)
    k, v = _kv(2, 3, 64, torch.bfloat16)
    store.write(0, plan, k, v)
    assert torch.equal(store.tails["k"][0][4, 2], k[0].to(torch.float16))
    assert torch.equal(store.tails["v"][0][1, 8], v[1].to(torch.float16))
    before = [t.clone() for t in (store.tails["k"][1], store.tails["v"][1])]
    for name, bad in (("k", "nan"), ("v", "inf")):
        k2, v2 = k.clone(), v.clone()
        (k2 if name == "k" else v2)[1, 2, 7] = float(bad)
        with pytest.raises(ValueError, match=f"^{name} contains NaN or inf"):
            store.write(1, plan, k2, v2)
    assert all(torch.equal(a, b) for a, b in zip(before, (store.tails["k"][1], store.tails["v"][1])))


def test_disabled_or_unread_inputs_take_the_torch_writes(monkeypatch):
    lens = [P + 3]
    (a, b), (pa, pb) = _stores_and_plan(lens)
    k, v = _kv(1, 3, 64, torch.float64)
    assert not cpu_store.append_tails(a, 0, pa, k, v)  # a dtype the kernel does not read
    a.write(0, pa, k, v)
    monkeypatch.setenv("HACK_CPU_STORE", "0")
    plan = b.plan(*_table_args(lens))
    assert not cpu_store.append_tails(b, 0, plan, k.float(), v.float())  # (read once per plan)
    b.write(0, plan, k, v)
    assert torch.equal(a.tails["k"][0], b.tails["k"][0]) and torch.equal(a.tails["v"][0], b.tails["v"][0])


def _table_args(lens: list[int]):
    rows = [4, 1, 0][: len(lens)]
    table = scattered_table(lens, P, 6, rows, 40, generator=torch.Generator().manual_seed(1))
    return table, rows, lens, [1] * len(lens)


def test_token_rows_apart_as_in_a_fused_projection_are_read_in_place():
    """K and V as SGLang hands them over: views into one [N, (Hq + 2 H) D] QKV output, each
    token's H x D values contiguous, tokens a whole row apart."""
    lens = [2 * P + 7, P + 20, 11]
    (ref, mine), (pr, pm) = _stores_and_plan(lens)
    k, v = _kv(3, 3, 64, torch.bfloat16, seed=4)
    qkv = torch.randn(3, (9 + 6) * 64).to(torch.bfloat16)
    kv = qkv[:, 9 * 64:].view(3, 2, 3, 64)
    kv[:, 0], kv[:, 1] = k, v
    ks, vs = qkv[:, 9 * 64:12 * 64].view(3, 3, 64), qkv[:, 12 * 64:].view(3, 3, 64)
    assert not ks.is_contiguous() and torch.equal(ks, k) and torch.equal(vs, v)
    append_to_tails(ref, 0, pr, k, v)
    assert cpu_store.append_tails(mine, 0, pm, ks, vs)
    for name in ("k", "v"):
        assert torch.equal(ref.tails[name][0].view(torch.int16), mine.tails[name][0].view(torch.int16)), name
    assert not cpu_store.append_tails(mine, 0, pm, ks.transpose(1, 2).contiguous().transpose(1, 2), vs)

