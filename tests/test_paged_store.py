"""The paged HACK store: what the write step puts in pages, tails and sinks, sink sharing
across requests that share a first page, and the plan's input checks."""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig, attention, pack, quantize
from hack_ops.paged import HackKVStore, decode, extend
from hack_ops.paged.fill import scattered_table, write_context

P = 32


def store_quant_kw(cfg: HackConfig) -> dict:
    """The options the store passes to quantize() for K/V pages (range search when the
    config has it)."""
    return {"range_search": cfg.range_search} if hasattr(cfg, "range_search") else {}


def _seq(n, heads=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    chan = (1 + torch.arange(d) % 7).float()
    k = (torch.randn(n, heads, d, generator=g) * chan).half().float()
    v = torch.randn(n, heads, d, generator=g).half().float()
    q = torch.randn(n, heads * 3, d, generator=g).half().float()
    return q, k, v


def _store(cfg, pages=16, rows=4, sink_slots=None):
    return HackKVStore(cfg, 1, 2, 64, num_pages=pages, num_rows=rows, num_sink_slots=sink_slots)


@pytest.mark.parametrize("orientation", ["channel_k", "token_k"])
@pytest.mark.parametrize("tails", ["kv", "per_channel"])
@pytest.mark.parametrize("bits", [{}, {"k_bits": 4}, {"kv_bits": 4, "k_bits": 2}], ids=["2bit", "k4v2", "k2v4"])
def test_pages_hold_the_reference_quantization(orientation, tails, bits):
    """Closed pages hold exactly quantize()'s codes and side tables (sinks masked out, with
    code 0 / min 0 / scale 0 on the per-token side), each tensor with its bits; K's stored sums
    are its code sums."""
    cfg = HackConfig(partition_size=P, orientation=orientation, tail_tensors=tails, sink_tokens=3, **bits)
    store = _store(cfg)
    n = 3 * P + 5
    table = scattered_table([n], P, 4, [2], 16, generator=torch.Generator().manual_seed(1))
    _, k, v = _seq(n)
    # token by token for the first page, then one chunk: both write paths
    for i in range(P):
        write_context(store, table, [2], [k[: i + 1]], [v[: i + 1]]) if i == 0 else None
        if i:
            plan = store.plan(table, [2], [i + 1])
            store.write(0, plan, k[i:i + 1], v[i:i + 1])
    plan = store.plan(table, [2], [n], [n - P])
    store.write(0, plan, k[P:], v[P:])
    lay = store.layout
    gd = cfg.head_group(64)
    sink = torch.arange(n) < 3
    for name, x in (("k", k), ("v", v)):
        tl, buf = getattr(lay, name), getattr(store, f"{name}_pages")[0]
        for pg in range(3):
            page_id = int(table[2, pg * P]) // P
            xs = x[pg * P:(pg + 1) * P]
            m = (~sink[pg * P:(pg + 1) * P])[:, None, None].expand(xs.shape)
            if tl.per_channel:
                qt = quantize(xs, cfg.bits(name), 0, P, mask=m, **store_quant_kw(cfg))
                mn, sc = qt.minimum[0], qt.scale[0]
            else:
                qt = quantize(xs, cfg.bits(name), -1, gd, mask=m, **store_quant_kw(cfg))
                sc = qt.scale.masked_fill(~m[:, :, :1], 0)
                mn, sc = qt.minimum.transpose(0, 1).reshape(2, -1), sc.transpose(0, 1).reshape(2, -1)
            codes = qt.codes.transpose(0, 1).contiguous()
            assert torch.equal(tl.view(buf, "codes")[page_id], pack(codes, cfg.bits(name))), (name, pg)
            assert torch.equal(tl.view(buf, "minimum")[page_id], mn)
            assert torch.equal(tl.view(buf, "scale")[page_id], sc)
            if name == "k":
                sums = codes.reshape(2, P, -1, gd).sum(-1).reshape(2, -1)
                assert torch.equal(tl.view(buf, "sums")[page_id].long(), sums.long())
    # the open page's tail-side tokens sit in the row's tail; sinks in the sink store
    for name in store.tails:
        x = k if name == "k" else v
        assert torch.equal(store.tails[name][0][2, :5].float(), x[3 * P:])
    slot = int(store.sink_map[int(table[2, 0]) // P])
    assert torch.equal(store.sink_k[0][slot].float(), k[:3]) and torch.equal(store.sink_v[0][slot].float(), v[:3])


def test_requant_ablation_requantizes_the_open_page():
    cfg = HackConfig(partition_size=P, requant_elimination=False, sink_tokens=0)
    store = _store(cfg)
    table = scattered_table([40], P, 4, [1], 16, generator=torch.Generator().manual_seed(2))
    _, k, v = _seq(40, seed=2)
    write_context(store, table, [1], [k[:37]], [v[:37]])
    page_id = int(table[1, P]) // P
    qt = quantize(k[P:37], cfg.kv_bits, 0, 5, **store_quant_kw(cfg))  # the open page's 5 tokens, per channel
    codes = store.layout.k.view(store.k_pages[0], "codes")[page_id, :, :5]
    assert torch.equal(codes, pack(qt.codes.transpose(0, 1).contiguous(), cfg.kv_bits))
    assert torch.equal(store.layout.k.view(store.k_pages[0], "minimum")[page_id], qt.minimum[0])


def test_sinks_survive_prefix_sharing():
    """Request B reuses A's first two pages (a radix-cache hit): B reads A's sinks, both decode
    correctly, and the sinks live until the shared first page is freed."""
    cfg = HackConfig(partition_size=P, sink_tokens=4)
    store = _store(cfg, pages=12, rows=4)
    qa, ka, va = _seq(80, seed=3)
    qb, kb, vb = _seq(90, seed=4)
    kb[: 2 * P], vb[: 2 * P] = ka[: 2 * P], va[: 2 * P]  # the shared prefix
    table = torch.zeros(4, 128, dtype=torch.int32)
    pages_a, pages_b = [5, 2, 9], [5, 2, 7]
    for row, pages in ((0, pages_a), (3, pages_b)):
        table[row, : 3 * P] = (torch.tensor(pages)[:, None] * P + torch.arange(P)).flatten().int()
    extend(store, 0, store.plan(table, [0], [79], [79]), qa[:79], ka[:79], va[:79])
    plan = store.plan(table, [3], [89], [89 - 2 * P])  # B: only its new tokens
    assert int(plan.sink_slot[0]) == int(store.sink_map[5])
    out_b = extend(store, 0, plan, qb[2 * P:89], kb[2 * P:89], vb[2 * P:89])
    plan = store.plan(table, [0, 3], [80, 90])
    out = decode(store, 0, plan, torch.stack([qa[79], qb[89]]), torch.stack([ka[79], kb[89]]), torch.stack([va[79], vb[89]]))
    t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    ref_a = attention(t(qa), t(ka), t(va), cfg, mode="hack")[0].transpose(0, 1)
    ref_b = attention(t(qb), t(kb), t(vb), cfg, mode="hack")[0].transpose(0, 1)
    assert float((out[0] - ref_a[79]).abs().max()) < 1.5e-2
    assert float((out[1] - ref_b[89]).abs().max()) < 1.5e-2
    assert float((out_b - ref_b[2 * P:89]).abs().amax(-1).median()) < 5e-5
    # freeing A's own last page keeps the sinks; freeing the shared first page releases them
    free_before = store.free_sink_slot_count
    assert store.free_sinks([9]) == 0
    assert store.free_sinks([5, 2]) == 1 and store.free_sink_slot_count == free_before + 1
    assert int(store.sink_map[5]) == -1
    with pytest.raises(RuntimeError, match="no sinks"):
        store.plan(table, [3], [91])


def test_sink_slots_run_out_with_a_clear_error():
    cfg = HackConfig(partition_size=P, sink_tokens=2)
    store = _store(cfg, pages=8, rows=4, sink_slots=1)
    table = scattered_table([10, 10], P, 4, [0, 1], 8, generator=torch.Generator().manual_seed(5))
    store.plan(table, [0], [10], [10])
    with pytest.raises(RuntimeError, match="out of sink slots"):
        store.plan(table, [1], [10], [10])
    store.free_sinks([int(table[0, 0]) // P])
    assert int(store.plan(table, [1], [10], [10]).sink_slot[0]) == 0


def test_plan_rejects_bad_tables():
    cfg = HackConfig(partition_size=P)
    store = _store(cfg)
    table = scattered_table([40, 20], P, 4, [0, 1], 16, generator=torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match="distinct"):
        store.plan(table, [0, 0], [40, 20], [40, 20])
    with pytest.raises(ValueError, match="rows must be in"):
        store.plan(table, [9], [40], [40])
    with pytest.raises(ValueError, match="ext_lens must not exceed"):
        store.plan(table, [0], [4], [5])
    bad = table.clone()
    bad[0, 35] += 1  # one token of the second page points into the wrong place
    with pytest.raises(ValueError, match="page-aligned"):
        store.plan(bad, [0], [40], [40])
    bad = table.clone()
    bad[0, P:2 * P] += 3  # a whole page shifted off its boundary
    with pytest.raises(ValueError, match="page-aligned"):
        store.plan(bad, [0], [40], [40])
    with pytest.raises(ValueError, match="refers to page"):
        HackKVStore(cfg, 1, 2, 64, num_pages=4, num_rows=4).plan(table, [0], [40], [40])


def test_write_rejects_bad_shapes_without_writing():
    cfg = HackConfig(partition_size=P)
    store = _store(cfg)
    table = scattered_table([8], P, 4, [0], 16, generator=torch.Generator().manual_seed(7))
    plan = store.plan(table, [0], [8], [8])
    _, k, v = _seq(8)
    with pytest.raises(ValueError, match="new_tokens, heads, head_dim"):
        store.write(0, plan, k[:7], v[:7])
    with pytest.raises(ValueError, match="floating-point"):
        store.write(0, plan, k.long(), v)
    assert int(store.sink_k[0].count_nonzero()) == 0 and int(store.tails["k"][0].count_nonzero()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused_wherever_it_is(dtype, bad):
    """The store's finiteness check (one min/max reduction) finds a NaN or an inf at the first,
    a middle and the last element of K or V, and nothing is written."""
    store = _store(HackConfig(partition_size=P))
    plan = store.plan(scattered_table([70], P, 4, [0], 16), [0], [70], [70])
    _, k, v = _seq(70)
    before = [t.clone() for t in (store.k_pages[0], store.v_pages[0], store.tails["k"][0], store.sink_k[0])]
    for which in ("k", "v"):
        for pos in (0, 70 * 2 * 64 // 2 + 3, 70 * 2 * 64 - 1):
            kv = {"k": k.to(dtype), "v": v.to(dtype)}
            kv[which] = kv[which].clone()
            kv[which].view(-1)[pos] = bad
            with pytest.raises(ValueError, match="NaN or inf"):
                store.write(0, plan, kv["k"], kv["v"])
    after = (store.k_pages[0], store.v_pages[0], store.tails["k"][0], store.sink_k[0])
    assert all(torch.equal(a, b) for a, b in zip(before, after))
