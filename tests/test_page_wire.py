"""The HACK page on the wire (hack_ops.page_wire): a page's wire prefix plus the receiver's
rebuild gives back the store's page bit for bit, on pages the store wrote (several layouts)
and on random code bytes."""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig
from hack_ops.page_wire import (PageTensor, derived_bytes, model_request_bytes, open_page_unread, page_code_sums,
                                rebuild_derived, request_bytes, wire_bytes, wire_page_bytes)
from hack_ops.layout import page_layout
from hack_ops.paged import HackKVStore
from hack_ops.paged.fill import scattered_table, write_context
from hack_ops.paged.store import StoreBackend

CONFIGS = [  # (config, KV heads, head_dim)
    (HackConfig(partition_size=64), 3, 64),  # SmolLM2's layout
    (HackConfig(partition_size=32, sink_tokens=3), 2, 64),
    (HackConfig(partition_size=64, kv_bits=4, meta_dtype="float32"), 1, 64),
    (HackConfig(partition_size=32, orientation="token_k", tail_tensors="per_channel"), 2, 64),
    (HackConfig(partition_size=64, sink_tokens=0, range_search=False), 1, 256),
    (HackConfig(partition_size=32, kv_bits=4, orientation="token_k", tail_tensors="kv", sink_tokens=2), 3, 64),
    (HackConfig(partition_size=32, k_bits=4, sink_tokens=1), 2, 64),  # K's codes and sums at 4 bits, V's at 2
]


def _written_store(cfg: HackConfig, heads: int, d: int, seed: int, backend: StoreBackend) -> tuple[HackKVStore, torch.Tensor, list[int]]:
    """A 2-layer store holding two requests (full pages and an open page each)."""
    p = cfg.partition_size
    lengths = [3 * p + 5, 2 * p]
    store = HackKVStore(cfg, 2, heads, d, num_pages=12, num_rows=3)
    g = torch.Generator().manual_seed(seed)
    table = scattered_table(lengths, p, 3, [0, 2], 12, generator=g)
    chan = (1 + torch.arange(d) % 5).float()
    ks = [(torch.randn(n, heads, d, generator=g) * chan).half().float() for n in lengths]
    vs = [torch.randn(n, heads, d, generator=g).half().float() for n in lengths]
    if backend is StoreBackend.AUTO:
        write_context(store, table, [0, 2], ks, vs)
    else:
        plan = store.plan(table, [0, 2], lengths, lengths)
        for layer in range(2):
            store.write(layer, plan, torch.cat(ks), torch.cat(vs), backend=backend)
    pages = sorted({int(x) // p for i, n in zip([0, 2], lengths) for x in table[i, :n:p]})
    return store, table, pages


@pytest.mark.parametrize("cfg,heads,d", CONFIGS)
@pytest.mark.parametrize("backend", [StoreBackend.AUTO, StoreBackend.TORCH])
def test_wire_prefix_plus_rebuild_is_the_stored_page(cfg: HackConfig, heads: int, d: int, backend: StoreBackend) -> None:
    store, _, pages = _written_store(cfg, heads, d, seed=heads * d + cfg.partition_size, backend=backend)
    lay = store.layout
    assert derived_bytes(lay.k) >= lay.k.sums.nbytes > 0 and wire_bytes(lay.v) == lay.v.scale.offset + lay.v.scale.nbytes
    # every page of the pool, the unwritten ones included (zero codes, zero sums)
    every = list(range(store.num_pages))
    for layer in range(2):
        src_k, src_v = store.k_pages[layer], store.v_pages[layer]
        assert bool(src_k[pages].any()), "the store wrote nothing"
        # the receiver's pool: only the wire prefix arrives (stale bytes elsewhere must go)
        dst_k = torch.zeros_like(src_k)
        dst_k[:, lay.k.sums.offset:lay.k.sums.offset + lay.k.sums.nbytes] = 0x5A
        dst_k[:, :wire_bytes(lay.k)] = src_k[:, :wire_bytes(lay.k)]
        dst_v = torch.zeros_like(src_v)
        dst_v[:, :wire_bytes(lay.v)] = src_v[:, :wire_bytes(lay.v)]
        rebuild_derived(lay, dst_k, every)
        assert torch.equal(dst_k, src_k), f"layer {layer}: K pages differ after the rebuild"
        assert torch.equal(dst_v, src_v)
        # the sums recomputed from the codes are the store's sums
        idx = torch.tensor(pages)
        assert torch.equal(page_code_sums(lay, PageTensor.K, src_k, idx), lay.k.view(src_k, "sums")[idx])


@pytest.mark.parametrize("bits,p,d", [(2, 64, 64), (4, 32, 64), (2, 32, 256), (4, 64, 256)])
def test_rebuild_on_random_codes_matches_the_group_sums(bits: int, p: int, d: int) -> None:
    cfg = HackConfig(partition_size=p, kv_bits=bits)
    lay = page_layout(cfg, 2, d)
    g = torch.Generator().manual_seed(bits * p + d)
    buf = torch.randint(0, 256, (5, lay.k.page_bytes), dtype=torch.uint8, generator=g)
    rebuild_derived(lay, buf, [0, 2, 4])
    gd = cfg.head_group(d)
    packed = lay.k.view(buf, "codes")  # [5, H, Π, D*bits/8]
    per_byte = 8 // bits
    codes = torch.stack([(packed.long() >> (bits * i)) & ((1 << bits) - 1) for i in range(per_byte)], -1)
    codes = codes.reshape(5, 2, p, d)  # packing is little-endian within a byte along head_dim
    want = codes.reshape(5, 2, p, d // gd, gd).sum(-1).reshape(5, 2, -1)
    got = lay.k.view(buf, "sums")
    assert torch.equal(got[[0, 2, 4]].long(), want[[0, 2, 4]])
    before = buf.clone()
    rebuild_derived(lay, buf, [])
    assert torch.equal(buf, before)


def test_wire_bytes_of_smollm2_pages() -> None:
    lay = page_layout(HackConfig(), 3, 64)
    # codes 3072 + min 384 + scale 384 per tensor; K's uint8 sums (192 B) stay home
    assert (wire_bytes(lay.k), wire_bytes(lay.v)) == (3840, 3840)
    assert lay.k.page_bytes - wire_bytes(lay.k) == 192
    assert wire_page_bytes(lay) == 7680 and lay.page_bytes == 7872


def test_request_bytes_of_smollm2_requests() -> None:
    """The numbers docs/disagg.md quotes: pages + FP16 tail slots (K and V) + one sink row. With
    hack_pages the pages travel as one run whose last page leaves its K sums (192 B) home."""
    lay = page_layout(HackConfig(), 3, 64)
    tail_sink = 30 * 2 * 384  # per token of FP16 K and V over 30 layers
    # 7,500 tokens: 117 full pages and a 12-token open partition
    assert request_bytes(lay, 30, 7500, hack_pages=False) == 118 * 30 * 7872 + 12 * tail_sink + tail_sink
    assert request_bytes(lay, 30, 7500) == 30 * (117 * 7872 - 192) + 12 * tail_sink + tail_sink == 27_924_480
    assert request_bytes(lay, 30, 7500, hack_pages=False) == 28_166_400
    assert request_bytes(lay, 30, 2048) == 30 * (32 * 7872 - 192) + tail_sink  # no open page to leave out
    # RQE off: the open page is read, so it travels (it ends the run: its sums stay home)
    no_rqe = page_layout(HackConfig(requant_elimination=False), 3, 64)
    assert request_bytes(no_rqe, 30, 100) - request_bytes(no_rqe, 30, 100, hack_pages=False) == -30 * 192
    # no sinks, no sink bytes
    assert request_bytes(page_layout(HackConfig(sink_tokens=0), 3, 64), 30, 64) == 30 * 7680


@pytest.mark.parametrize("hack_pages", [True, False])
def test_model_request_bytes_sums_each_layers_own_layout(hack_pages: bool) -> None:
    """Per-layer bits: the sum over the layouts the store builds (HackKVStore.layouts), and more
    than all-2-bit by exactly the raised layers' difference; uniform configs equal request_bytes."""
    cfg, n_layers, n = HackConfig(four_bit_layers=(1, 4)), 6, 300
    store = HackKVStore(cfg, n_layers, 3, 64, num_pages=1, num_rows=1)
    per_layer = sum(request_bytes(lay, 1, n, hack_pages=hack_pages) for lay in store.layouts)
    assert model_request_bytes(cfg, n_layers, 3, 64, n, hack_pages=hack_pages) == per_layer
    two, four = (request_bytes(page_layout(c, 3, 64), 1, n, hack_pages=hack_pages)
                 for c in (HackConfig(), HackConfig(kv_bits=4)))
    assert four > two
    assert per_layer == 4 * two + 2 * four
    assert model_request_bytes(HackConfig(), 30, 3, 64, 7500, hack_pages=hack_pages) == request_bytes(
        page_layout(HackConfig(), 3, 64), 30, 7500, hack_pages=hack_pages)


def test_open_page_is_unread_only_when_both_tails_hold_it() -> None:
    assert open_page_unread(HackConfig())
    assert not open_page_unread(HackConfig(orientation="channel_k", tail_tensors="per_channel"))
    assert not open_page_unread(HackConfig(requant_elimination=False))
