"""HACK pages on the PD path without their derived bytes (disagg.hack_wire, --hack-kv-codec
hack-pages), without servers: a prefill-side HackWire sends store-written pages through a fake
transfer engine (memmove between buffers, as Mooncake writes them) into a decode-side pool,
which rebuilds K's code sums; the digest both sides compute agrees, and a damaged code fails it."""
from __future__ import annotations

import argparse
import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from disagg import connector, hack_wire, transfer_codec
from disagg.hack_wire import HackWire
from disagg.pd_state import HackStateIndices
from disagg.transfer_codec import KvCodec
from hack_ops import HackConfig
from hack_ops.page_wire import wire_page_bytes
from hack_ops.paged import HackKVStore
from hack_ops.paged.fill import scattered_table, write_context

LAYERS, HEADS, DIM, PAGES = 2, 3, 64, 16


class FakeManager:
    """What HackWire.send uses of MooncakeKVManager: _transfer_data."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0

    def _transfer_data(self, session_id: str, blocks: list) -> int:
        self.calls += 1
        for src, dst, n in blocks:
            ctypes.memmove(dst, src, n)
            self.bytes += n
        return 0


def _pool(cfg: HackConfig) -> SimpleNamespace:
    store = HackKVStore(cfg, LAYERS, HEADS, DIM, num_pages=PAGES, num_rows=2)
    return SimpleNamespace(store=store, page_size=cfg.partition_size,
                           k_buffer=store.k_pages, v_buffer=store.v_pages)


def _wire(pool: SimpleNamespace) -> HackWire:
    bufs = list(pool.k_buffer) + list(pool.v_buffer)
    return HackWire(pool, [b.data_ptr() for b in bufs], [b[0].nbytes for b in bufs])


def _request(cfg: HackConfig, n: int, seed: int) -> tuple[SimpleNamespace, list[int]]:
    """A prefill pool holding one n-token request; its pages in sequence order."""
    pool = _pool(cfg)
    p = cfg.partition_size
    g = torch.Generator().manual_seed(seed)
    table = scattered_table([n], p, 2, [1], PAGES, generator=g)
    k = (torch.randn(n, HEADS, DIM, generator=g) * (1 + torch.arange(DIM) % 5)).half().float()
    v = torch.randn(n, HEADS, DIM, generator=g).half().float()
    write_context(pool.store, table, [1], [k], [v])
    return pool, [int(x) // p for x in table[1, :n:p]]


def _computer(pool: SimpleNamespace) -> SimpleNamespace:
    bufs = list(pool.k_buffer) + list(pool.v_buffer)
    return SimpleNamespace(_kv_data_ptrs=[b.data_ptr() for b in bufs], _kv_item_lens=[b[0].nbytes for b in bufs],
                           _state_data_ptrs=[], _state_item_lens=[])


def _digest(pool: SimpleNamespace, pages: list[int], live: int) -> int:
    """The digest as the connector's hook computes it (CPU, open page left out with hack-pages)."""
    state = HackStateIndices(row=0, live=live, num_tail=0, page_size=pool.page_size)
    return connector.PdConnector.checksum(None, _computer(pool), torch.tensor(pages), state)


@pytest.fixture()
def active():
    """Install a HackWire as the process's transform for the connector hooks, then remove it."""
    def put(w: HackWire) -> HackWire:
        hack_wire._wire[:] = [w]
        return w
    yield put
    hack_wire._wire[:] = []


def _transfer(cfg: HackConfig, n: int, seed: int, active) -> tuple:
    pre_pool, src_pages = _request(cfg, n, seed)
    dec_pool = _pool(cfg)
    for b in list(dec_pool.k_buffer) + list(dec_pool.v_buffer):
        b.fill_(0xA5)  # stale bytes of earlier requests
    pre, dec = _wire(pre_pool), _wire(dec_pool)
    dst_pages = [PAGES - 1 - i for i in range(len(src_pages))]  # reversed: no contiguous runs
    kv, sl = pre.trim_open_page(np.array(src_pages, dtype=np.int32), slice(0, len(src_pages)), True, n)
    mgr = FakeManager()
    dst_ptrs = [b.data_ptr() for b in list(dec_pool.k_buffer) + list(dec_pool.v_buffer)]
    assert pre.send(mgr, "s", kv, dst_ptrs, np.array(dst_pages)[sl]) == 0
    dec.rebuild(dst_pages)
    return pre_pool, dec_pool, src_pages, dst_pages, mgr, pre, dec


@pytest.mark.parametrize("cfg,n", [(HackConfig(partition_size=64), 3 * 64 + 20),
                                   (HackConfig(partition_size=32, sink_tokens=3, kv_bits=4), 4 * 32),
                                   (HackConfig(partition_size=32, tail_tensors="per_channel"), 2 * 32 + 7),
                                   (HackConfig(partition_size=32, four_bit_layers=(1,)), 3 * 32 + 9),
                                   (HackConfig(partition_size=32, four_bit_layers=(1,), raised_tensors="k"), 2 * 32 + 5)],
                         ids=lambda x: x.label() if isinstance(x, HackConfig) else str(x))
def test_sent_pages_arrive_bitwise_with_fewer_bytes(cfg: HackConfig, n: int, active) -> None:
    pre_pool, dec_pool, src, dst, mgr, pre, dec = _transfer(cfg, n, seed=n, active=active)
    p = cfg.partition_size
    open_skipped = n % p and pre.skip_open
    sent = src[:-1] if open_skipped else src
    for a, b in zip(list(pre_pool.k_buffer) + list(pre_pool.v_buffer), list(dec_pool.k_buffer) + list(dec_pool.v_buffer)):
        for s, d in zip(sent, dst):
            assert torch.equal(a[s], b[d])
    lays = pre_pool.store.layouts  # layer 1 of the last case holds 4-bit pages, layer 0 2-bit ones
    assert mgr.bytes == len(sent) * sum(wire_page_bytes(lay) for lay in lays)
    assert mgr.bytes < len(src) * sum(lay.page_bytes for lay in lays)
    assert pre.stats["open_pages_skipped"] == (1 if open_skipped else 0)
    # the digest both sides compute agrees (the unsent open page left out of it) ...
    active(pre)
    live = n % p
    want = _digest(pre_pool, src, live)
    active(dec)
    assert _digest(dec_pool, dst, live) == want
    # ... and a flipped code byte of a sent page fails it
    dec_pool.k_buffer[1][dst[0], 5] ^= 0x21
    dec.rebuild(dst)
    assert _digest(dec_pool, dst, live) != want


def test_the_open_page_is_sent_when_decode_reads_it(active) -> None:
    cfg = HackConfig(partition_size=32, orientation="channel_k", tail_tensors="per_channel")  # V per token, no tail
    pre, dec, src, dst, mgr, w, _ = _transfer(cfg, 2 * 32 + 7, seed=3, active=active)
    assert not w.skip_open and len(src) == 3
    for a, b in zip(pre.v_buffer, dec.v_buffer):
        assert torch.equal(a[src[-1]], b[dst[-1]])


def test_trim_only_the_last_chunk_with_an_open_page() -> None:
    w = _wire(_pool(HackConfig(partition_size=64)))
    idx = np.array([4, 5, 6], dtype=np.int32)
    kv, sl = w.trim_open_page(idx, slice(2, 5), True, 150)
    assert kv.tolist() == [4, 5] and sl == slice(2, 4)
    for args in ((False, 150), (True, 192), (True, None)):
        kv, sl = w.trim_open_page(idx, slice(2, 5), *args)
        assert kv.tolist() == [4, 5, 6] and sl == slice(2, 5)


def test_pages_contiguous_on_both_sides_go_as_one_block() -> None:
    w = _wire(_pool(HackConfig(partition_size=64)))
    bufs = w.pool.k_buffer + w.pool.v_buffer
    blocks = w.blocks([3, 4, 5, 9], [b.data_ptr() for b in bufs], [7, 8, 9, 1])
    assert len(blocks) == 2 * LAYERS * 2  # runs [3-5 -> 7-9] and [9 -> 1], for K and V of every layer
    k_item, k_wire, v_item = bufs[0][0].nbytes, w.wire_lens[0], bufs[LAYERS][0].nbytes
    assert k_wire < k_item and w.wire_lens[LAYERS] == v_item
    k0 = [b for b in blocks if b[0] in (bufs[0].data_ptr() + 3 * k_item, bufs[0].data_ptr() + 9 * k_item)]
    # a K run ends at its last page's scale section (its sums stay home); the pages before it go whole
    assert k0 == [(bufs[0].data_ptr() + 3 * k_item, bufs[0].data_ptr() + 7 * k_item, 2 * k_item + k_wire),
                  (bufs[0].data_ptr() + 9 * k_item, bufs[0].data_ptr() + 1 * k_item, k_wire)]
    v0 = [b for b in blocks if b[0] == bufs[LAYERS].data_ptr() + 3 * v_item]
    assert v0 == [(bufs[LAYERS].data_ptr() + 3 * v_item, bufs[LAYERS].data_ptr() + 7 * v_item, 3 * v_item)]


def _ns(**kw) -> argparse.Namespace:
    base = dict(hack_kv_codec="hack-pages", disaggregation_mode="decode", disaggregation_transfer_backend="mooncake_tcp",
                disaggregation_enable_kv_checksum=True, kv_cache_dtype="hack", dtype="auto")
    return argparse.Namespace(**{**base, **kw})


def test_options_are_checked_with_a_sentence() -> None:
    assert transfer_codec.check_options(_ns()) is KvCodec.HACK_PAGES
    assert transfer_codec.check_options(_ns(hack_kv_codec="none")) is KvCodec.NONE
    with pytest.raises(ValueError, match="needs --kv-cache-dtype hack"):
        transfer_codec.check_options(_ns(kv_cache_dtype="auto"))
    with pytest.raises(ValueError, match="use --hack-kv-codec hack-pages"):
        transfer_codec.check_options(_ns(hack_kv_codec="splitzip"))
    with pytest.raises(ValueError, match="--disaggregation-mode"):
        transfer_codec.check_options(_ns(disaggregation_mode="null"))


def test_mismatch_sentence_names_the_transform() -> None:
    fp = "hack:v2:P64:0a1b2c3d:smollm2:L30"
    msg = (f"prefill server has kv_cache_dtype={fp}+hack-pages:1, but decode server has kv_cache_dtype={fp}. x")
    reason = connector.incompatible_reason(msg, "10.0.0.2:8998")
    assert "prefill uses KV transfer codec hack-pages (version 1)" in reason
    assert "decode uses no KV transfer codec" in reason and "--hack-kv-codec" in reason
    assert transfer_codec.split_fingerprint(f"{fp}+hack-pages:1") == (fp, "+hack-pages:1")


def test_hack_methods_use_the_transform_and_one_turns_it_off() -> None:
    from disagg.server_cmd import server_command

    for method in ("hack", "hack-homomorphic-prefill", "hack-exact-prefill", "hack-dense-prefill"):
        cmd = server_command("prefill", method, "/m", "h", 1, 2, 100)
        assert cmd[cmd.index("--hack-kv-codec") + 1] == "hack-pages"
        if method == "hack":
            assert "--hack-prefill" not in cmd  # the server's default, auto
        else:
            assert cmd[cmd.index("--hack-prefill") + 1] == method.split("-")[1]
    off = server_command("decode", "hack-full-pages", "/m", "h", 1, None, 100)
    assert off[off.index("--hack-kv-codec") + 1] == "none" and off[off.index("--kv-cache-dtype") + 1] == "hack"
    assert "--hack-kv-codec" not in server_command("colocated", "hack", "/m", "h", 1, None, 100)
    dq = server_command("prefill", "dequant", "/m", "h", 1, 2, 100)
    assert "--hack-kv-codec" not in dq
