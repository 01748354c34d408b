"""The page tier in process (engine.page_tier): records are sealed and refused when damaged, a HACK
request's pages and sinks go to SGLang's file storage backend and come back into other slots exactly
(the next decode step reads what it read in place), damaged, truncated and sink-less records shorten
the hit instead of being served, the BF16 baseline's pages round-trip, and the option is refused
where it cannot work. The real-server cases are tests/test_page_tier_server.py."""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from engine import cpu_runtime  # noqa: E402

cpu_runtime.prepare()

from engine import page_tier  # noqa: E402
from engine import settings as settings_mod  # noqa: E402
from engine.page_tier.page_bytes import (SINK_SUFFIX, DamagedRecord, TokenPages, seal,  # noqa: E402
                                         unseal)
from engine.pool import HackKVPool, pool_build_context  # noqa: E402
from hack_ops.paged import decode  # noqa: E402

HEADS, DIM, LAYERS = 3, 64, 2


@pytest.fixture()
def hack_env(monkeypatch):
    monkeypatch.setenv(settings_mod.ENV_VAR, settings_mod.EngineSettings().to_json())


def _pool(pages: int = 20) -> HackKVPool:
    with pool_build_context(rows=4, budget=None):
        return HackKVPool(size=64 * pages, page_size=64, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM,
                          layer_num=LAYERS, device="cpu", enable_memory_saver=False, v_head_dim=DIM,
                          start_layer=0, end_layer=LAYERS - 1)


def _linker(pool, path: Path, monkeypatch, **extra):
    import sglang.srt.runtime_context as rc

    from engine.page_tier.linker import PageTierLinker

    monkeypatch.setattr(rc, "get_model", lambda: SimpleNamespace(model_path="/models/test-model"))
    params = SimpleNamespace(page_size=64, token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool))
    return PageTierLinker(None, params, components=None, extra_config={"path": str(path), **extra})


def _kv(keys, slots=None):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return [PoolTransfer(name=PoolName.KV, keys=list(keys), device_indices=slots)]


def test_a_record_is_refused_when_damaged_truncated_or_under_another_key():
    payload = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    rec = seal("k1", payload, flags=1)
    body, flags = unseal("k1", rec, 1000)
    assert torch.equal(body, payload) and flags == 1
    bad = rec.clone()
    bad[100] ^= 1
    with pytest.raises(DamagedRecord, match="digest"):
        unseal("k1", bad, 1000)
    with pytest.raises(DamagedRecord, match="bytes, expected"):
        unseal("k1", rec[:-1], 1000)
    with pytest.raises(DamagedRecord, match="digest"):
        unseal("k2", rec, 1000)
    with pytest.raises(DamagedRecord, match="header"):
        unseal("k1", seal("k1", payload[:999]).clone().resize_(rec.numel()), 1000)


def _written_request(pool, n: int, first_page: int, seed: int = 0):
    """A request of n tokens written into pages first_page.. of row 1; returns (r2t, q, k, v)."""
    store = pool.store
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n + 1, HEADS, DIM, generator=g), torch.randn(n + 1, HEADS, DIM, generator=g)
    q = torch.randn(1, 9, DIM, generator=g)
    r2t = torch.zeros(4, 512, dtype=torch.int64)
    r2t[1, :192] = torch.arange(192) + first_page * 64
    plan = store.plan(r2t, [1], [n], [n])
    for layer in range(LAYERS):
        store.write(layer, plan, k[:n], v[:n])
    return r2t, q, k, v


def _decode(pool, r2t, row, n, q, k, v):
    store = pool.store
    return [decode(store, layer, store.plan(r2t, [row], [n + 1]), q, k[n:], v[n:]) for layer in range(LAYERS)]


def test_hack_pages_and_sinks_come_back_into_other_slots_exactly(hack_env, tmp_path, monkeypatch):
    """Offload a 2-page prefix (its first page owns the sinks), free and poison the pages, restore
    them into other pages: the next decode step reads exactly what it read in place."""
    pool = _pool()
    store = pool.store
    n = 128  # two closed pages, nothing open: what the radix cache stores
    r2t, q, k, v = _written_request(pool, n, first_page=7)
    before = _decode(pool, r2t, 1, n, q, k, v)
    linker = _linker(pool, tmp_path, monkeypatch)
    keys = ["a" * 64, "b" * 64]
    assert linker.offload(_kv(keys, r2t[1, :n].clone()))
    linker.drain()
    assert linker.num_completed_offloads() == 1 and linker.pop_completed_offload() is True
    assert linker.stats.offloaded_pages == 2
    names = sorted(os.listdir(tmp_path))
    assert any(SINK_SUFFIX in f for f in names) and len([f for f in names if f.endswith(".bin")]) == 3

    store.free_sinks(torch.tensor([7, 8]))
    for buf in store.k_pages + store.v_pages:
        buf[7:9] = 0xA5
    assert linker.lookup("r", _kv(keys)) == [1, 2]
    r2t[1] = 0
    r2t[3, :192] = torch.arange(192) + 12 * 64  # pages 12, 13, 14 in row 3
    assert linker.load("r", _kv(keys, r2t[3, :n].clone()))
    index = linker.start_layer_wise_loading()
    assert index >= 0 and linker.finish_layer_wise_loading(index)
    assert int(store.sink_map[12]) >= 0 and int(store.sink_map[13]) < 0
    after = _decode(pool, r2t, 3, n, q, k, v)
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    rep = linker.report()
    assert rep["loaded_pages"] == 2 and rep["restored_tokens"] == 128 and rep["files"] == 3
    assert rep["refused_records"] == 0 and rep["hit_rate"] == 1.0
    linker.close()


def _stored(pool, tmp_path, monkeypatch, keys):
    r2t, *_ = _written_request(pool, 64 * len(keys), first_page=7)
    linker = _linker(pool, tmp_path, monkeypatch)
    assert linker.offload(_kv(keys, r2t[1, :64 * len(keys)].clone()))
    linker.drain()
    return linker


def _file(tmp_path: Path, key: str) -> Path:
    (hit,) = [p for p in tmp_path.iterdir() if p.name.startswith(key + "_")]
    return hit


@pytest.mark.parametrize("damage", ["flip", "truncate", "sinks", "swap"])
def test_a_damaged_record_shortens_the_hit_and_is_never_loaded(hack_env, tmp_path, monkeypatch, damage):
    """A flipped byte, a truncated file, a first page whose sinks are gone, a record under another
    key: lookup stops before it (its tokens are recomputed), counting the refusal."""
    pool = _pool()
    keys = ["c" * 64, "d" * 64, "e" * 64]
    linker = _stored(pool, tmp_path, monkeypatch, keys)
    linker._verified.clear()
    if damage == "flip":
        f = _file(tmp_path, keys[1])
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        f.write_bytes(bytes(raw))
        expect = [1]
    elif damage == "truncate":
        f = _file(tmp_path, keys[2])
        f.write_bytes(f.read_bytes()[:-7])
        expect = [1, 2]
    elif damage == "sinks":
        _file(tmp_path, keys[0] + SINK_SUFFIX).unlink()
        expect = []
    else:  # the second page's record copied over the third's
        _file(tmp_path, keys[2]).write_bytes(_file(tmp_path, keys[1]).read_bytes())
        expect = [1, 2]
    assert linker.lookup("r", _kv(keys)) == expect
    assert linker.stats.refused_records == 1
    refused = keys[len(expect)]  # removed, so that the page's next offload writes it again
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(refused + "_")]
    linker.close()


def test_a_load_whose_record_vanished_fails_the_batch(hack_env, tmp_path, monkeypatch):
    """Between lookup and load a record can only vanish from the verified cache's reach if the cache
    dropped it; then the load fails and SGLang aborts the request (never serves unknown bytes)."""
    pool = _pool()
    keys = ["f" * 64]
    linker = _stored(pool, tmp_path, monkeypatch, keys)
    assert linker.lookup("r", _kv(keys)) == [1]
    linker._verified.clear()
    _file(tmp_path, keys[0]).unlink()
    linker.load("r", _kv(keys, torch.arange(64) + 12 * 64))
    index = linker.start_layer_wise_loading()
    assert linker.finish_layer_wise_loading(index) is False and linker.stats.failed_loads == 1
    linker.close()


def test_bf16_token_pages_round_trip():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(size=64 * 6, page_size=64, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False, start_layer=0,
                            end_layer=LAYERS - 1)
    fmt = TokenPages.of(pool, "m")
    assert fmt.page_bytes == LAYERS * 2 * 64 * HEADS * DIM * 2
    for b in (*pool.k_buffer, *pool.v_buffer):
        b.copy_(torch.randn(b.shape).to(b.dtype))
    data = fmt.read_page(2)
    fmt.write_page(4, data)
    for b in (*pool.k_buffer, *pool.v_buffer):
        assert torch.equal(b[128:192], b[256:320])
    other = TokenPages.of(pool, "another-model")
    assert other.namespace != fmt.namespace


@pytest.mark.parametrize("given, refusal", [
    (dict(disable_radix_cache=True), "drop --disable-radix-cache"),
    (dict(disaggregation_mode="decode"), "give it to the prefill server"),
    (dict(enable_hierarchical_cache=True), "use one"),
    (dict(hack_page_tier_size="lots"), "expected a size"),
    (dict(hack_page_tier=None, hack_page_tier_size="4G"), "turn the tier on"),
    (dict(tp_size=2), "--tp-size 2 is not supported"),
    (dict(pp_size=2), "--pp-size 2 is not supported"),
    (dict(hack_page_tier=""), "needs a directory"),
    (dict(hack_page_tier="/proc/version/tier"), "--hack-page-tier /proc/version/tier: "),
])
def test_the_option_is_refused_where_it_cannot_work(given, refusal, tmp_path):
    ns = SimpleNamespace(**{"hack_page_tier": str(tmp_path / "t"), "hack_page_tier_size": None, **given})
    with pytest.raises(page_tier.TierRefusal, match=refusal):
        page_tier.apply(ns)


def test_the_option_sets_sglangs_linker(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = SimpleNamespace(hack_page_tier="tier", hack_page_tier_size="2G")
    page_tier.apply(ns)
    assert (tmp_path / "tier").is_dir()
    assert ns.enable_unified_cache_external_linker and ns.unified_cache_external_linker_backend == "dynamic"
    cfg = ns.unified_cache_external_linker_config
    assert cfg["linker"] == "PageTierLinker" and cfg["linker_module_path"] == "engine.page_tier.linker"
    assert cfg["linker_extra_config"] == {"path": os.path.abspath("tier"), "max_size": "2G"}
    from sglang.srt.mem_cache.unified_cache.linker_config import UnifiedCacheLinkerConfig

    UnifiedCacheLinkerConfig.from_dict(cfg)  # SGLang's own check of the dynamic backend's config


def test_a_capped_tier_forgets_the_oldest_pages_and_never_refuses_for_it(hack_env, tmp_path, monkeypatch):
    """`--hack-page-tier-size`: SGLang's file evictor removes the least recently used records; a
    prefix whose records went is a plain miss (recomputed), not a refusal."""
    from engine.page_tier.page_bytes import sealed_size

    pool = _pool()
    record = sealed_size(sum(b.shape[1] for b in (*pool.store.k_pages, *pool.store.v_pages)))
    linker = _linker(pool, tmp_path, monkeypatch, max_size=str(int(record * 3.5)))
    r2t, *_ = _written_request(pool, 128, first_page=7)
    chains = [[f"{c}{i}" * 32 for i in range(2)] for c in "pqrs"]  # four 2-page prefixes (no sinks: pages 8, 9)
    for keys in chains:
        slots = torch.arange(128) + 8 * 64
        assert linker.offload(_kv(keys, slots))
        linker.drain()
    assert linker.report()["bytes_on_disk"] <= record * 3.5
    assert linker.lookup("old", _kv(chains[0])) == []
    assert linker.lookup("new", _kv(chains[-1])) == [1, 2]
    assert linker.stats.refused_records == 0
    linker.close()
