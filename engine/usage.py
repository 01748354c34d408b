"""KV memory in use, as the scheduler sees it (served in /server_info internal_states[].hack_kv).

`used_tokens` counts allocated KV slots (whole pages on a paged pool); `radix_cached_tokens`
what the radix tree keeps for reuse. With no request running, used == cached and no request
row is held: anything else is leaked memory. For a HACK pool the page/tail/sink details follow.
"""
from __future__ import annotations

from typing import Any


def _int(fn: Any) -> int | None:
    try:
        v = fn()
    except Exception:  # a cache type without the accessor: report what is known
        return None
    if isinstance(v, tuple):  # some caches report (full, swa)
        v = v[0]
    return int(v)


def kv_usage(scheduler: Any) -> dict:
    alloc = scheduler.token_to_kv_pool_allocator
    total = int(scheduler.max_total_num_tokens)
    available = int(alloc.available_size())
    tree = getattr(scheduler, "tree_cache", None)
    req_pool = scheduler.req_to_token_pool
    out: dict[str, Any] = {
        "max_total_num_tokens": total,
        "available_tokens": available,
        "used_tokens": total - available,
        "radix_cached_tokens": None,
        "radix_evictable_tokens": None,
        "request_rows_total": int(req_pool.size),
        "request_rows_in_use": int(req_pool.size - req_pool.available_size()),
        "hack": None,
    }
    if tree is not None:
        evictable = _int(tree.evictable_size)
        protected = _int(tree.protected_size)
        out["radix_evictable_tokens"] = evictable
        if evictable is not None and protected is not None:
            out["radix_cached_tokens"] = evictable + protected
    pool = alloc.get_kvcache()
    from .pool import HackKVPool

    if isinstance(pool, HackKVPool):
        out["hack"] = pool.usage()
    return out
