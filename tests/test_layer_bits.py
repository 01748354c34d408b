"""Per-layer bits served (HackConfig.four_bit_layers, edge_layer_bits): the paged store lays out
each layer with its own bits, and every paged path (PyTorch store and attention, compiled store
and kernels, the dequantizing baseline) reads a layer of a mixed store exactly as it reads a
store whose every layer has that layer's bits. Bytes and outputs are compared bit for bit: the
only thing per-layer bits may change is which layout a layer uses.
The pool's sizes, the PD wire (tests/test_hack_wire.py) and the startup refusal of layers a
model lacks (tests/test_engine_startup.py) are checked where those live."""
from __future__ import annotations

import os

import pytest
import torch

from hack_ops import HackConfig, attention
from hack_ops.paged import HackKVStore, cpu_kernel, cpu_store, decode, extend
from hack_ops.paged.fill import scattered_table
from hack_ops.paged.store import StoreBackend

LAYERS, HEADS, REP, DIM, P = 4, 2, 3, 64, 32
MIXED = HackConfig(partition_size=P, four_bit_layers=(1, 3), range_search=False)


def _data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(n, HEADS, DIM, generator=g) * (1 + torch.arange(DIM) % 5)).half().float()
    v = torch.randn(n, HEADS, DIM, generator=g).half().float()
    q = torch.randn(n, HEADS * REP, DIM, generator=g).half().float()
    return q, k, v


def test_each_layer_is_laid_out_with_its_bits():
    store = HackKVStore(MIXED, LAYERS, HEADS, DIM, num_pages=5, num_rows=2)
    two, four = (HackKVStore(HackConfig(partition_size=P, kv_bits=b, range_search=False), 1, HEADS, DIM,
                             num_pages=5, num_rows=2) for b in (2, 4))
    assert [store.config_for(i).kv_bits for i in range(LAYERS)] == [2, 4, 2, 4]
    for i, ref in enumerate((two, four, two, four)):
        assert store.layout_for(i) == ref.layout
        assert store.k_pages[i].shape == ref.k_pages[0].shape and store.v_pages[i].shape == ref.v_pages[0].shape
    assert store.layout_for(1) is store.layout_for(3)  # one layout object per distinct config
    assert store.page_bytes() == 2 * two.layout.page_bytes + 2 * four.layout.page_bytes
    assert four.layout.page_bytes > two.layout.page_bytes
    with pytest.raises(ValueError, match="layout_for"):
        store.layout  # noqa: B018  no single layout to hand out
    assert HackKVStore(HackConfig(), 2, HEADS, DIM, num_pages=2, num_rows=1).layout.config.kv_bits == 2
    with pytest.raises(ValueError, match="beyond the model's 4 layers"):
        HackKVStore(HackConfig(four_bit_layers=(4,)), LAYERS, HEADS, DIM, num_pages=2, num_rows=1)


def _run(cfg: HackConfig, layers: list[int], num_layers: int, store_backend: StoreBackend, attn_backend: str,
         mode: str = "hack"):
    """Prefill two requests in chunks, then decode steps, writing layer `l` of a store of
    num_layers layers for each l in `layers` (the same K/V for every layer). Returns the store
    and, per layer, the outputs of every forward."""
    total = [3 * P + 5, 2 * P - 3]
    pages = sum(-(-n // P) for n in total) + 2
    store = HackKVStore(cfg, num_layers, HEADS, DIM, num_pages=pages, num_rows=3)
    table = scattered_table(total, P, 3, [0, 2], pages, generator=torch.Generator().manual_seed(7))
    data = [_data(n + 4, seed=11 + i) for i, n in enumerate(total)]
    outs: dict[int, list[torch.Tensor]] = {l: [] for l in layers}
    done = [0, 0]
    for step in ([P + 5, 20], [2 * P, 2 * P - 23], [1, 1], [1, 1], [1, 1], [1, 1]):
        lens = [d + s for d, s in zip(done, step)]
        q = torch.cat([data[i][0][done[i]:lens[i]] for i in (0, 1)])
        k = torch.cat([data[i][1][done[i]:lens[i]] for i in (0, 1)])
        v = torch.cat([data[i][2][done[i]:lens[i]] for i in (0, 1)])
        is_decode = step == [1, 1]
        plan = store.plan(table, [0, 2], lens, None if is_decode else step)
        for l in layers:
            if is_decode:
                store.write(l, plan, k, v, backend=store_backend)
                outs[l].append(decode(store, l, plan, q, mode=mode, backend=attn_backend))
            else:
                outs[l].append(extend(store, l, plan, q, k, v, mode=mode, backend=attn_backend))
        done = lens
    return store, outs


def _need_compiled() -> None:
    if cpu_store.load() is None or cpu_kernel.load() is None:
        pytest.skip("no C compiler: the compiled store and kernels cannot be built")


@pytest.mark.parametrize("path", ["torch", "cpu", "dequant"])
def test_a_layer_of_a_mixed_store_equals_a_uniform_store_of_its_bits(path):
    """Every byte a layer holds and every output it gives, against a one-layer store whose
    config is that layer's (for_layer): 2-bit layers 0 and 2, 4-bit layers 1 and 3."""
    if path == "cpu":
        _need_compiled()
    store_backend = StoreBackend.CPU if path == "cpu" else StoreBackend.TORCH
    attn_backend = "cpu" if path == "cpu" else "torch"
    mode = "dequant" if path == "dequant" else "hack"
    mixed, outs = _run(MIXED, [0, 1], LAYERS, store_backend, attn_backend, mode)
    for layer in (0, 1):
        ref, ref_outs = _run(MIXED.for_layer(layer, LAYERS), [0], 1, store_backend, attn_backend, mode)
        assert mixed.config_for(layer).kv_bits == (4 if layer == 1 else 2)
        for name in ("k_pages", "v_pages", "sink_k", "sink_v"):
            assert torch.equal(getattr(mixed, name)[layer], getattr(ref, name)[0]), f"{name}[{layer}]"
        for name in mixed.tails:
            assert torch.equal(mixed.tails[name][layer], ref.tails[name][0])
        for got, want in zip(outs[layer], ref_outs[0]):
            assert torch.equal(got, want)


def test_four_bit_layers_are_closer_to_exact():
    """What the bits buy: the 4-bit layer's decode output is nearer exact attention than the
    2-bit layer's on the same K/V (2-bit error here ~0.1-0.3; 4-bit several times smaller)."""
    _, outs = _run(MIXED, [0, 1], LAYERS, StoreBackend.TORCH, "torch")
    total = 3 * P + 5
    q, k, v = _data(total + 4, seed=11)
    # request 0's first decode step is its token at position total (the 3rd forward)
    t = total + 1
    ref = attention(q[:t].transpose(0, 1)[None], k[:t].transpose(0, 1)[None], v[:t].transpose(0, 1)[None],
                    config=HackConfig(), mode="exact", causal=True)[0].transpose(0, 1)[-1]
    err2 = float((outs[0][2][0] - ref).abs().max())
    err4 = float((outs[1][2][0] - ref).abs().max())
    assert err4 < err2 / 3, (err2, err4)


def test_edge_layer_bits_are_served_the_same_way():
    cfg = HackConfig(partition_size=P, edge_layer_bits=4, range_search=False)
    store = HackKVStore(cfg, 5, HEADS, DIM, num_pages=4, num_rows=1)
    assert [store.config_for(i).kv_bits for i in range(5)] == [4, 2, 2, 2, 4]
    assert store.k_pages[0].shape[1] > store.k_pages[1].shape[1] == store.k_pages[3].shape[1]


def test_the_pool_sizes_count_each_layers_bytes(monkeypatch):
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from engine import cpu_runtime

    cpu_runtime.prepare()
    from engine.pool_geometry import token_bytes, unit_bytes

    two = HackConfig()
    mixed = HackConfig(four_bit_layers=(7, 14, 15, 17, 18, 20, 21, 23))  # SmolLM2's retrieval layers
    u2, u4 = unit_bytes(two, 3, 64, 30), unit_bytes(HackConfig(kv_bits=4), 3, 64, 30)
    um = unit_bytes(mixed, 3, 64, 30)
    assert um.page == pytest.approx((22 * u2.page + 8 * u4.page) / 30)
    assert um.row == u2.row and um.sink_slot == u2.sink_slot  # tails and sinks are FP16 either way
    assert token_bytes(u2, 30) < token_bytes(um, 30) < token_bytes(u4, 30)
    with pytest.raises(ValueError, match="num_layers"):
        unit_bytes(mixed, 3, 64)
