"""HackKVPool in process: buffers follow hack_ops.layout, sizes are reported truthfully (so
capacity grows), pages move as opaque bytes, sink slots follow page lifetimes, and token-row
paths that would misread the bytes are refused."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from engine import cpu_runtime  # noqa: E402

cpu_runtime.prepare()

from engine import hooks  # noqa: E402
from engine import settings as settings_mod  # noqa: E402
from engine.pool import HackKVPool, pool_build_context  # noqa: E402
from engine.pool_geometry import row_bytes, token_bytes, unit_bytes  # noqa: E402
from hack_ops import HackConfig, PrefillMode  # noqa: E402
from hack_ops.paged import decode, extend  # noqa: E402

# SmolLM2-135M: 30 layers, 3 KV heads of 64
LAYERS, HEADS, DIM = 30, 3, 64
BF16_TOKEN_BYTES = LAYERS * 2 * HEADS * DIM * 2


@pytest.fixture()
def hack_env(monkeypatch):
    monkeypatch.setenv(settings_mod.ENV_VAR, settings_mod.EngineSettings().to_json())


def _pool(rows=4, pages=20, layers=2, **kw) -> HackKVPool:
    with pool_build_context(rows=rows, budget=None):
        return HackKVPool(size=64 * pages, page_size=64, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM,
                          layer_num=layers, device="cpu", enable_memory_saver=False, v_head_dim=DIM,
                          start_layer=0, end_layer=layers - 1, **kw)


def test_capacity_at_least_five_times_bf16_under_one_budget():
    u = unit_bytes(HackConfig(), HEADS, DIM)
    per_token = token_bytes(u, LAYERS)
    assert BF16_TOKEN_BYTES / per_token > 6.0  # pages alone: ~16% of BF16
    budget = 256 << 20
    rows = int(budget * 0.125) // row_bytes(u, LAYERS)  # the default share for request rows
    hack_tokens = (budget - (rows + 1) * row_bytes(u, LAYERS)) // per_token
    assert hack_tokens / (budget // BF16_TOKEN_BYTES) >= 5.0


def test_buffers_and_sizes_follow_the_layout(hack_env):
    pool = _pool()
    lay = pool.store.layout
    assert len(pool.k_buffer) == 2 and pool.k_buffer[0].dtype == torch.uint8
    assert tuple(pool.k_buffer[0].shape) == (21, lay.k.page_bytes)  # page 0 = SGLang's padding page
    assert tuple(pool.v_buffer[1].shape) == (21, lay.v.page_bytes)
    assert all(t.is_contiguous() for t in pool.k_buffer + pool.v_buffer)
    k, v = pool.get_kv_size_bytes()
    nb = pool.store.nbytes()
    assert k + v == sum(nb.values())  # pages, tails and sinks all reported
    assert pool.get_v_head_dim() == DIM  # never inferred from byte buffers
    # the transfer engine sees whole pages as items
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert items == [lay.k.page_bytes] * 2 + [lay.v.page_bytes] * 2
    assert ptrs[0] == pool.k_buffer[0].data_ptr() and ptrs[2] == pool.v_buffer[0].data_ptr()
    assert lens[0] == 21 * lay.k.page_bytes


def test_layers_with_more_bits_have_wider_items(monkeypatch):
    """--hack-4bit-layers: each buffer describes its own page size to the transfer engine (the
    base class would repeat layer 0's), and the sizes SGLang reads count every layer's bytes."""
    monkeypatch.setenv(settings_mod.ENV_VAR, settings_mod.EngineSettings(
        config=HackConfig(four_bit_layers=(1,))).to_json())
    pool = _pool(layers=3)
    two, four = pool.store.layout_for(0), pool.store.layout_for(1)
    assert four.k.page_bytes > two.k.page_bytes and four.v.page_bytes > two.v.page_bytes
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert items == [two.k.page_bytes, four.k.page_bytes, two.k.page_bytes,
                     two.v.page_bytes, four.v.page_bytes, two.v.page_bytes]
    assert lens == [21 * n for n in items] and ptrs[1] == pool.k_buffer[1].data_ptr()
    k, v = pool.get_kv_size_bytes()
    assert k + v == sum(pool.store.nbytes().values())
    assert pool.usage()["layout"]["layer_bits"] == [2, 4, 2]


def test_token_row_paths_are_refused(hack_env):
    pool = _pool()
    for call in (lambda: pool.set_kv_buffer(None, torch.tensor([1]), torch.zeros(1, 3, 64), torch.zeros(1, 3, 64)),
                 lambda: pool.move_kv_cache(torch.tensor([1]), torch.tensor([2])),
                 lambda: pool.get_cpu_copy(torch.tensor([1]))):
        with pytest.raises(NotImplementedError, match="only by the 'hack' attention backend"):
            call()


def test_pool_needs_hack_settings_and_matching_page_size(monkeypatch):
    monkeypatch.delenv(settings_mod.ENV_VAR, raising=False)
    with pytest.raises(RuntimeError, match="needs --kv-cache-dtype hack"):
        _pool()
    monkeypatch.setenv(settings_mod.ENV_VAR, settings_mod.EngineSettings(
        config=HackConfig(partition_size=32)).to_json())
    with pytest.raises(ValueError, match="page_size 64 != HACK partition size 32"):
        _pool()


def test_sink_slots_follow_the_first_page(hack_env):
    pool = _pool()
    store = pool.store
    r2t = torch.zeros(4, 512, dtype=torch.int64)
    r2t[1, :128] = torch.arange(128) + 5 * 64  # pages 5 and 6
    plan = store.plan(r2t, [1], [100], [100])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(100, n, DIM, generator=g) for n in (9, 3, 3))
    extend(store, 0, plan, q, k, v)
    assert pool.usage()["sink_slots_in_use"] == 1
    released = []

    def original(alloc, *page_ids):
        released.append(torch.cat(page_ids).tolist())

    class Alloc:
        def get_kvcache(self):
            return pool

    hooks._around_release_page_ids(original, Alloc(), torch.tensor([6]))  # not a first page
    assert pool.usage()["sink_slots_in_use"] == 1
    hooks._around_release_page_ids(original, Alloc(), torch.tensor([5]))
    assert pool.usage()["sink_slots_in_use"] == 0
    assert released == [[6], [5]]  # the allocator still frees the pages itself


def test_decode_reads_the_pool_it_wrote(hack_env):
    """A store written through the pool answers decode like a fresh dense reference would
    (the detailed math is hack_ops.paged's tests; here: the pool wires it without copies)."""
    pool = _pool(layers=1)
    store = pool.store
    r2t = torch.zeros(4, 512, dtype=torch.int64)
    r2t[2, :192] = torch.arange(192) + 64
    g = torch.Generator().manual_seed(1)
    n = 130
    k, v = torch.randn(n + 1, 3, DIM, generator=g), torch.randn(n + 1, 3, DIM, generator=g)
    q = torch.randn(n + 1, 9, DIM, generator=g)
    extend(store, 0, store.plan(r2t, [2], [n], [n]), q[:n], k[:n], v[:n])
    out = decode(store, 0, store.plan(r2t, [2], [n + 1], [1]), q[n:], k[n:], v[n:])
    from hack_ops import attention

    ref = attention(q[n:].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                    config=HackConfig(), mode="exact", causal=True)[0].transpose(0, 1)
    # 2-bit cache vs exact: close but not equal (random data is the worst case for 2 bits)
    err = (out.float() - ref).abs().max().item()
    assert 1e-4 < err < 0.5, err


def test_gpu_plan_conversion_and_refusals(hack_env):
    """The CUDA path cannot run here (no GPU); its plan conversion is plain torch and its
    refusals happen at construction, both checked on the CPU."""
    from engine.gpu_attention import GpuAttention

    pool = _pool()
    store = pool.store
    r2t = torch.zeros(4, 512, dtype=torch.int64)
    r2t[0, :128] = torch.arange(128) + 7 * 64  # pages 7, 8
    r2t[3, :64] = torch.arange(64) + 2 * 64  # page 2
    plan = store.plan(r2t, [0, 3], [100, 10], [100, 10])
    indptr, indices = plan.csr_pages(torch.device("cpu"))
    assert indptr.tolist() == [0, 2, 3] and indices.tolist() == [7, 8, 2]
    assert indptr.dtype == indices.dtype == torch.int32
    from engine.prefill_choice import choose_prefill

    for attention, prefill in (("dequant", "homomorphic"), ("hack", "exact")):
        s = settings_mod.EngineSettings(attention=attention, prefill=prefill)
        resolved, _ = choose_prefill(s.prefill, s.attention, "cuda", torch.bfloat16, has_amx_bf16=True)
        with pytest.raises(NotImplementedError, match="CPU path only"):
            GpuAttention(store, s, resolved)
    for prefill in ("homomorphic", "dense"):  # the two a GPU runs
        GpuAttention(store, settings_mod.EngineSettings(prefill=prefill), PrefillMode(prefill))
    default = settings_mod.EngineSettings()  # the default format and prefill ('auto') the kernels cover
    resolved, _ = choose_prefill(default.prefill, default.attention, "cuda", torch.bfloat16, has_amx_bf16=True)
    assert resolved == PrefillMode.DENSE
    GpuAttention(store, default, resolved)
    # per-layer bits: every layer's layout passes the kernels' spec check (2- and 4-bit pages)
    from hack_ops.paged import HackKVStore

    mixed = HackKVStore(HackConfig(four_bit_layers=(1,)), 3, HEADS, DIM, num_pages=4, num_rows=2)
    GpuAttention(mixed, default, resolved)


def test_decode_tail_append_matches_the_store_write(hack_env):
    """The store's path for decode tokens that only append to the FP16 tails (HackKVStore.write,
    backend 'auto') leaves the pool exactly as the reference store step does (and is not
    taken for sinks or closing pages); bad input is refused before anything is written."""
    from hack_ops.paged.write import appends_only

    g = torch.Generator().manual_seed(3)
    a, b = _pool(layers=1), _pool(layers=1)
    r2t = torch.zeros(4, 512, dtype=torch.int64)
    r2t[1, :128] = torch.arange(128) + 3 * 64
    r2t[2, :128] = torch.arange(128) + 9 * 64
    k0, v0 = torch.randn(2, 70, 3, DIM, generator=g), torch.randn(2, 70, 3, DIM, generator=g)
    for pool in (a, b):
        for i, row in enumerate((1, 2)):
            extend(pool.store, 0, pool.store.plan(r2t, [row], [70], [70]), torch.randn(70, 9, DIM, generator=g),
                   k0[i], v0[i])
    plan_a = a.store.plan(r2t, [1, 2], [71, 71])
    plan_b = b.store.plan(r2t, [1, 2], [71, 71])
    cfg = a.store.config
    assert plan_a.appends_only and appends_only(cfg, plan_a)
    assert not a.store.plan(r2t, [1, 2], [71, 64]).appends_only  # position 63 closes page 0
    assert not appends_only(cfg, a.store.plan(r2t, [3], [1]))  # position 0 is a sink
    k, v = torch.randn(2, 3, DIM, generator=g), torch.randn(2, 3, DIM, generator=g)
    a.store.write(0, plan_a, k, v, backend="torch")
    b.store.write(0, plan_b, k, v)
    for name in ("k", "v"):
        assert torch.equal(a.store.tail(name, 0), b.store.tail(name, 0))
    assert torch.equal(a.k_buffer[0], b.k_buffer[0]) and torch.equal(a.v_buffer[0], b.v_buffer[0])
    assert torch.equal(a.store.sink_k[0], b.store.sink_k[0])
    q = torch.randn(2, 9, DIM, generator=g)
    assert torch.equal(decode(a.store, 0, plan_a, q), decode(b.store, 0, plan_b, q))
    tails = b.store.tail("k", 0).clone()
    with pytest.raises(ValueError, match="NaN or inf"):
        b.store.write(0, plan_b, torch.full((2, 3, DIM), float("nan")), v)
    assert torch.equal(b.store.tail("k", 0), tails)


def test_sink_slots_run_short_and_come_back_from_the_cache(hack_env):
    """More cached first pages than sink slots (many short prompts): the next new sequence gets
    a slot by evicting cached sequences least recently used first (engine.sink_reclaim), never
    one that is running; without a cache to take from, the store refuses with its sentence."""
    from engine import sink_reclaim

    pool = _pool(rows=2, pages=40)  # 2 rows + 40 // 16 = 4 slots
    store = pool.store
    assert store.num_sink_slots == 4

    class Tree:  # the radix cache's eviction contract: LRU leaves, pages freed through the allocator
        def __init__(self) -> None:
            self.cached: list[int] = []  # first pages of cached sequences, oldest first

        def evictable_size(self) -> int:
            return 64 * len(self.cached)

        def evict(self, params):
            from sglang.srt.mem_cache.base_prefix_cache import EvictResult

            if not self.cached:
                return EvictResult()
            page = self.cached.pop(0)
            hooks._around_release_page_ids(lambda *a: None, Alloc(), torch.tensor([page]))
            return EvictResult(num_tokens_evicted=64)

    class Alloc:
        def get_kvcache(self):
            return pool

    tree = Tree()
    for page in (3, 4, 5, 6):  # four finished prompts of one page each, all cached
        store.sink_slots_for(torch.tensor([page]), allocate=True)
        tree.cached.append(page)
    assert store.free_sink_slot_count == 0
    with pytest.raises(RuntimeError, match="out of sink slots"):
        store.sink_slots_for(torch.tensor([9]), allocate=True)

    class Scheduler:
        token_to_kv_pool_allocator = type("A", (), {"get_kvcache": lambda self: pool})()
        tree_cache = tree

    sink_reclaim.install(Scheduler())
    slots = store.sink_slots_for(torch.tensor([9, 10]), allocate=True)  # two new sequences
    assert sorted(slots.tolist()) == sorted(set(slots.tolist())) and (slots >= 0).all()
    assert tree.cached == [5, 6]  # the two oldest went, nothing more
    assert int(store.sink_map[3]) == -1 and int(store.sink_map[5]) >= 0
    tree.cached.clear()  # everything left is running (locked): nothing to evict
    with pytest.raises(RuntimeError, match="out of sink slots"):
        store.sink_slots_for(torch.tensor([11, 12, 13]), allocate=True)


@pytest.mark.parametrize("n", [130, 128, 40])
def test_a_retracted_request_comes_back_where_sglang_puts_it(hack_env, n):
    """PD decode's retraction backup (`--disaggregation-decode-retraction-backup cpu_tensor`):
    SGLang copies a retracted request's KV off the pool (its token slots and request row), frees
    them, and later loads the copy into other slots and another row. The next decode step must read
    exactly what it would have read in place: pages (every layer), the open page's FP16 tail rows
    and the sinks under the new first page. Open pages of 2, 0 and 40 tokens."""
    from hack_ops.paged import offload

    pool = _pool(layers=2)
    store = pool.store
    g = torch.Generator().manual_seed(n)
    k, v = torch.randn(n + 1, 3, DIM, generator=g), torch.randn(n + 1, 3, DIM, generator=g)
    q = torch.randn(1, 9, DIM, generator=g)
    r2t = torch.zeros(4, 512, dtype=torch.int64)
    r2t[1, :192] = torch.arange(192) + 7 * 64  # pages 7, 8, 9 in row 1
    plan = store.plan(r2t, [1], [n], [n])
    for layer in range(2):
        store.write(layer, plan, k[:n], v[:n])
    step = store.plan(r2t, [1], [n + 1])
    before = [decode(store, layer, step, q, k[n:], v[n:]) for layer in range(2)]

    # the same decode step again, on the request moved: SGLang's slots exclude the new token
    r2t_old = r2t.clone()
    for layer in range(2):  # undo the step's write of token n (a retraction drops it too)
        store.write(layer, store.plan(r2t_old, [1], [n], [n]), k[:n], v[:n])
    copy = pool.get_cpu_copy(r2t[1, :n], req_pool_index=1)
    assert copy.tokens == n and copy.nbytes > 0 and copy.k_pages[0].device.type == "cpu"
    # what a page tier stores is the copy's bytes: the rest of the test runs on their round trip
    raw = copy.to_bytes()
    assert len(raw) == copy.nbytes
    copy = offload.RequestCopy.from_bytes(store, n, raw)
    assert copy.to_bytes() == raw
    with pytest.raises(ValueError, match=f"a {n}-token request of this layout"):
        offload.RequestCopy.from_bytes(store, n, raw[:-1])
    hooks._around_release_page_ids(lambda *a: None, type("A", (), {"get_kvcache": lambda s: pool})(),
                                   torch.tensor([7, 8, 9]))
    for buf in store.k_pages + store.v_pages:  # the freed pages get other requests' bytes
        buf[7:10] = 0xA5
    for ts in store.tails.values():
        for t in ts:
            t[1] = float("nan")
    r2t[1] = 0
    r2t[3, :192] = torch.arange(192) + 12 * 64  # pages 12, 13, 14 in row 3
    pool.load_cpu_copy(copy, r2t[3, :n], req_pool_index=3)
    after = [decode(store, layer, store.plan(r2t, [3], [n + 1]), q, k[n:], v[n:]) for layer in range(2)]
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="holds 130 tokens|holds 128 tokens|holds 40 tokens"):
        pool.load_cpu_copy(copy, r2t[3, : n - 1], req_pool_index=3)
    with pytest.raises(NotImplementedError):
        pool.load_cpu_copy(object(), r2t[3, :n], req_pool_index=3)


def test_offload_refuses_slots_that_are_not_whole_pages(hack_env):
    from hack_ops.paged import offload

    pool = _pool()
    with pytest.raises(ValueError, match="whole pages in order"):
        offload.save(pool.store, torch.tensor([64, 65, 130]), 1)
    with pytest.raises(ValueError, match="outside the store's 4 rows"):
        offload.save(pool.store, torch.arange(64, 70), 9)
