"""Sink slots come back from the radix cache when a server runs short of them.

A HACK pool keeps each sequence's sink tokens in a slot held as long as the sequence's first
page lives (hack_ops.paged.store). The pool sizes the slots for caches whose sequences average
16 pages or more; a cache of many short prompts (chat traffic) holds more first pages than
that, and without this the next new sequence found no slot and the scheduler died
(`out of sink slots`, seen in `hack bench soak` with a small KV budget). SGLang already evicts
cached sequences, least recently used first, when it needs pages; this does the same when the
store needs sink slots: a cached sequence's slot is freed with its first page
(engine.hooks: PagedTokenToKVPoolAllocator._release_page_ids -> HackKVPool.on_pages_freed).
Running requests hold their pages locked in the tree, so they are never evicted; a pool has
at least one slot per request row, so evicting every unlocked sequence always frees enough.
"""
from __future__ import annotations

from typing import Any


def reclaim(tree_cache: Any, store: Any, needed: int) -> int:
    """Evict cached sequences, least recently used first, until `needed` sink slots are free
    or nothing is evictable. Returns how many slots were freed."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    before = store.free_sink_slot_count
    # One page of tokens per round: the radix cache evicts whole leaves (whole pages), and a
    # slot is freed only when a sequence's first page goes, so the loop stops as soon as it can.
    while store.free_sink_slot_count < needed and tree_cache.evictable_size() > 0:
        if tree_cache.evict(EvictParams(num_tokens=store.page_size)).num_tokens_evicted <= 0:
            break
    return store.free_sink_slot_count - before


def install(scheduler: Any) -> None:
    """Let the scheduler's HACK pool reclaim sink slots from its radix cache (idempotent)."""
    from .pool import HackKVPool

    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    tree = getattr(scheduler, "tree_cache", None)
    if not isinstance(pool, HackKVPool) or tree is None or pool.store.reclaim_sink_slots is not None:
        return
    store = pool.store
    store.reclaim_sink_slots = lambda n: reclaim(tree, store, n)
