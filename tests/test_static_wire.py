"""Static eviction over PD (disagg.static_wire), without servers: the kept set survives its
staging row; the last chunk's indices carry which pages each layer sends through SGLang's
transfer queue; HackWire leaves a layer's dropped pages off the wire and sends the rest
bitwise; the digest both sides compute covers what each layer sent and agrees; the prefill
stage and the decode install move a set from one server's keeper to the other's."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from disagg import connector, hack_wire, pd_state, static_wire
from disagg.pd_state import HackStateIndices
from disagg.static_wire import KeptIndices, KeptStaging, chunk_keep
from hack_ops import HackConfig
from hack_ops.page_wire import wire_page_bytes
from hack_ops.paged.static_keep import KeptPages, StaticKeepPages
from hack_ops.static_keep import KeepUnit, StaticKeep
from test_hack_wire import HEADS, LAYERS, FakeManager, _computer, _pool, _request, _wire


def _kept(prompt_pages: int, per_layer: dict[int, list[list[int]]]) -> KeptPages:
    return KeptPages(prompt_pages, {layer: torch.tensor(pos) for layer, pos in per_layer.items()})


@pytest.mark.parametrize("unit", list(KeepUnit))
def test_a_kept_set_survives_its_staging_row(unit):
    store = _pool(HackConfig(partition_size=32)).store
    staging = KeptStaging.for_store(store, unit, max_pages=21)
    assert staging.max_pages == 24 and staging.bits.shape == (2, LAYERS, 1 if unit == KeepUnit.PAGE else HEADS, 3)
    if unit == KeepUnit.PAGE:
        kept = _kept(20, {0: [[0, 3, 19]] * HEADS})  # layer 1 has no set (a sliding-window layer)
    else:
        kept = _kept(20, {0: [[0, 3, 19], [0, 4, 19], [0, 5, 19]], 1: [[0, 1, 2]] * HEADS})
    staging.stage(1, kept)
    got = staging.read(1)
    assert got.prompt_pages == 20 and set(got.positions) == set(kept.positions)
    for layer, pos in kept.positions.items():
        assert torch.equal(got.positions[layer], pos)
    staging.stage(1, None)  # the next request of the row has no set: nothing of the old one stays
    assert staging.read(1) is None and int(staging.bits[1].sum()) == 0
    staging.meta[0] = torch.tensor([20, 2, -1], dtype=torch.int32)  # a count the bits do not match
    staging.bits[0, 0, :, 0] = 0b1011
    with pytest.raises(ValueError, match="lists 3 pages, its count says 2"):
        staging.read(0)
    with pytest.raises(ValueError, match="does not fit"):
        staging.stage(0, _kept(30, {}))


def test_chunk_masks_and_the_indices_that_carry_them():
    mask = torch.tensor([[True, False, False, True, True], [True, True, False, False, True]])
    keep = chunk_keep(mask, slice(3, 9), 6)  # positions 3..8: two prompt pages, then later ones
    assert keep.tolist() == [[True, True, True, True, True, True], [False, True, True, True, True, True]]
    idx = KeptIndices.wrap(np.array([7, 8, 9, 10, 11, 12], dtype=np.int32), keep)
    assert idx.keep is keep and idx.tolist() == [7, 8, 9, 10, 11, 12]
    assert idx[:4].keep is None  # SGLang's truncation no longer lines up: every page goes
    kept = _kept(5, {1: [[0, 4]] * HEADS})
    assert kept.page_mask(LAYERS).tolist() == [[True] * 5, [True, False, False, False, True]]


@pytest.fixture()
def active():
    yield
    hack_wire._wire[:] = []
    static_wire._active[:] = []


def test_dropped_pages_stay_off_the_wire_and_the_digests_agree(active):
    cfg = HackConfig(partition_size=32)
    n = 6 * 32 + 9  # six closed pages and an open one
    pre_pool, src = _request(cfg, n, seed=11)
    dec_pool = _pool(cfg)
    for b in list(dec_pool.k_buffer) + list(dec_pool.v_buffer):
        b.fill_(0xA5)  # stale bytes: what decode holds where a page never arrives
    pre, dec = _wire(pre_pool), _wire(dec_pool)
    kept = _kept(6, {0: [[0, 2, 5]] * HEADS, 1: [[0, 1, 4]] * HEADS})
    mask = kept.page_mask(LAYERS)
    dst = [15 - i for i in range(len(src))]
    kv, sl = pre.trim_open_page(np.array(src, dtype=np.int32), slice(0, len(src)), True, n)
    kv = KeptIndices.wrap(kv, chunk_keep(mask, sl, len(kv)))
    mgr = FakeManager()
    dst_ptrs = [b.data_ptr() for b in list(dec_pool.k_buffer) + list(dec_pool.v_buffer)]
    assert pre.send(mgr, "s", kv, dst_ptrs, np.array(dst)[sl]) == 0
    dec.rebuild(dst)
    lays = pre_pool.store.layouts
    per_layer_page = [wire_page_bytes(lay) for lay in lays]
    assert mgr.bytes == 3 * per_layer_page[0] + 3 * per_layer_page[1]  # half of six pages, per layer
    assert pre.stats["evicted_layer_pages"] == 6
    for layer in range(LAYERS):
        for bufs in ((pre_pool.k_buffer, dec_pool.k_buffer), (pre_pool.v_buffer, dec_pool.v_buffer)):
            for i in range(6):
                sent = torch.equal(bufs[0][layer][src[i]], bufs[1][layer][dst[i]])
                assert sent == bool(mask[layer, i]), (layer, i)
    # both sides digest what each layer sent, reading the set from the request's staging row
    digests = []
    for pool, pages, wire in ((pre_pool, src, pre), (dec_pool, dst, dec)):
        staging = KeptStaging.for_store(pool.store, KeepUnit.PAGE, 8)
        staging.stage(0, kept)
        static_wire.activate(staging, pd_state.buffer_layers(pool))
        hack_wire._wire[:] = [wire]
        state = HackStateIndices(row=0, live=n % 32, num_tail=0, page_size=32)
        digests.append(connector.PdConnector.checksum(None, _computer(pool), torch.tensor(pages), state))
    assert digests[0] == digests[1]
    dec_pool.k_buffer[1][dst[1], 3] ^= 0x40  # a page layer 1 kept, damaged
    assert connector.PdConnector.checksum(None, _computer(dec_pool), torch.tensor(dst), state) != digests[0]


def test_stage_on_prefill_and_install_on_decode_move_the_set(active):
    store_cfg = HackConfig(partition_size=32)
    pools = []
    for _ in range(2):
        pool = _pool(store_cfg)
        pool.hack_settings, pool.layer_num = SimpleNamespace(static=StaticKeep(keep=0.5)), LAYERS
        pool.static_keep = StaticKeepPages(StaticKeep(keep=0.5))
        assert pd_state.kept_staging(pool, max_pages=10) is pool.disagg_kept_staging
        pools.append(pool)
    pre, dec = pools
    kept = _kept(6, {0: [[0, 3, 5]] * HEADS})
    pre.static_keep.install(1, kept)
    static_wire.stage_for_send(pre, 1, room=77)
    assert static_wire.pending.take(77).tolist()[0] == [True, False, False, True, False, True]
    dec.disagg_kept_staging.meta.copy_(pre.disagg_kept_staging.meta)  # the state component's transfer
    dec.disagg_kept_staging.bits.copy_(pre.disagg_kept_staging.bits)
    static_wire.install_received(dec, 1, "r")
    got = dec.static_keep.kept(1)
    assert got.prompt_pages == 6 and torch.equal(got.positions[0], kept.positions[0])
    pre.static_keep.install(1, None)  # the row's next request has no set: decode reads all of it
    static_wire.stage_for_send(pre, 1, room=78)
    assert static_wire.pending.take(78) is None
    dec.disagg_kept_staging.meta.copy_(pre.disagg_kept_staging.meta)
    static_wire.install_received(dec, 1, "r")
    assert dec.static_keep.kept(1) is None
    # the fingerprint says the kept sets travel (a decode server without them would not pair)
    fp = pd_state.layout_fingerprint(pre, model="m")
    plain = pd_state.layout_fingerprint(SimpleNamespace(store=pre.store, layer_num=LAYERS), model="m")
    assert fp.startswith(plain) and fp != plain
    assert "static eviction on" in pd_state.describe_fingerprint(fp)
    assert "static eviction" not in pd_state.describe_fingerprint(plain)


def test_the_cluster_methods_and_hack_up_flag():
    from disagg.cluster import ClusterSpec
    from disagg.server_cmd import is_method, method_flags, static_keep_of
    from hack_cli.cmd_cluster import spec_from_args
    from hack_cli.main import build_parser

    assert static_keep_of("hack-static-0.5") == 0.5 and is_method("hack-static-0.25") and not is_method("hack-static-1")
    assert method_flags("hack-static-0.5") == [*method_flags("hack"), "--hack-static-keep", "0.5"]
    with pytest.raises(FileNotFoundError):  # the method passes; the model folder is checked next
        ClusterSpec(model_path="/nonexistent", kv="hack-static-0.5").validate()
    with pytest.raises(ValueError, match="hack-static-FRACTION"):
        ClusterSpec(model_path="/nonexistent", kv="hack-static-x").validate()
    up = lambda *a: spec_from_args(build_parser().parse_args(["up", *a]))  # noqa: E731
    assert up("--static-keep", "0.4").extra_server_args == ["--hack-static-keep", "0.4"]
    assert up("--static-keep", "1").extra_server_args == []  # keep everything: off
    with pytest.raises(ValueError, match="--kv bf16 has none"):
        up("--kv", "bf16", "--static-keep", "0.5")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--static-keep", "0"])
