"""KV memory of a server: the one place that counts it (the /server_info report, the metrics
sampler and the BF16-equivalent bytes of a transfer all read it from here).

`kv_usage` is served in /server_info internal_states[].hack_kv: `used_tokens` counts allocated
KV slots (whole pages on a paged pool); `radix_cached_tokens` what the radix tree keeps for
reuse. With no request running, used == cached and no request row is held: anything else is
leaked memory. For a HACK pool the page/tail/sink details follow.

`memory_sample` is what the metrics sampler records once a second: pages, and for a HACK pool
its codes / side tables / FP16 tails, with the BF16 bytes the same tokens would take.
"""
from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Any

from .pool_geometry import bf16_bytes_per_token


def pool_bf16_bytes_per_token(pool: Any) -> int:
    """The BF16 bytes per token of a KV pool's model geometry (0 for a pool without heads,
    e.g. an MLA pool: its BF16 equivalent is not defined here)."""
    if not hasattr(pool, "head_num") or not hasattr(pool, "head_dim"):
        return 0
    return bf16_bytes_per_token(getattr(pool, "layer_num", 0), pool.head_num, pool.head_dim)


def _int(fn: Any) -> int | None:
    try:
        v = fn()
    except Exception:  # a cache type without the accessor: report what is known
        return None
    if isinstance(v, tuple):  # some caches report (full, swa)
        v = v[0]
    return int(v)


def _used_tokens(scheduler: Any) -> tuple[int, int]:
    """(total, used) KV slots of the scheduler's allocator."""
    total = int(scheduler.max_total_num_tokens)
    return total, total - int(scheduler.token_to_kv_pool_allocator.available_size())


def _request_rows(req_pool: Any) -> int:
    """Every row the request pool hands out: `size` (the running requests) plus, on a PD decode
    server, `pre_alloc_size` rows for requests still arriving (SGLang's DecodeReqToTokenPool;
    2x the running batch when --max-running-requests is small). Counting `size` alone made an
    idle decode server report -24 rows in use at --max-running-requests 12."""
    return int(req_pool.size) + int(getattr(req_pool, "pre_alloc_size", 0) or 0)


def _rows_in_use(scheduler: Any) -> int:
    req_pool = scheduler.req_to_token_pool
    return _request_rows(req_pool) - int(req_pool.available_size())


def kv_usage(scheduler: Any) -> dict:
    total, used = _used_tokens(scheduler)
    tree = getattr(scheduler, "tree_cache", None)
    out: dict[str, Any] = {
        "max_total_num_tokens": total,
        "available_tokens": total - used,
        "used_tokens": used,
        "radix_cached_tokens": None,
        "radix_evictable_tokens": None,
        "request_rows_total": _request_rows(scheduler.req_to_token_pool),
        "request_rows_in_use": _rows_in_use(scheduler),
        "hack": None,
        "page_tier": None,
    }
    if tree is not None:
        evictable = _int(tree.evictable_size)
        protected = _int(tree.protected_size)
        out["radix_evictable_tokens"] = evictable
        if evictable is not None and protected is not None:
            out["radix_cached_tokens"] = evictable + protected
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    from .pool import HackKVPool

    if isinstance(pool, HackKVPool):
        out["hack"] = pool.usage()
    out["page_tier"] = page_tier_report(tree)
    return out


def page_tier_report(tree: Any) -> dict | None:
    """The page tier's counters and size (engine.page_tier), or None without one."""
    from .page_tier.linker import PageTierLinker

    linker = getattr(getattr(tree, "linker", None), "cache_linker", None)
    return linker.report() if isinstance(linker, PageTierLinker) else None


def is_idle(usage: dict | None) -> bool:
    """Whether a `kv_usage` report (as /server_info serves it) shows a server at rest: no
    request row held and no KV slot used beyond what the radix cache keeps (nothing at all
    without a radix cache). Anything else with no request running is leaked memory."""
    if not usage:
        return False
    return usage.get("request_rows_in_use") == 0 and usage.get("used_tokens") == (usage.get("radix_cached_tokens") or 0)


def memory_sample(scheduler: Any) -> dict:
    """One metrics sample (engine.metrics.sample fields) of the scheduler's KV memory."""
    from .pool import HackKVPool

    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    page = max(1, int(getattr(pool, "page_size", 1)))
    total, used = _used_tokens(scheduler)
    out = {"pages_used": used // page, "pages_total": total // page,
           "bytes_bf16": used * pool_bf16_bytes_per_token(pool),
           "running": len(scheduler.running_batch.reqs), "queued": len(scheduler.waiting_queue)}
    tier = page_tier_report(getattr(scheduler, "tree_cache", None))
    if tier is not None:
        out.update(tier_bytes=tier["bytes_on_disk"], tier_hit_pages=tier["hit_pages"],
                   tier_asked_pages=tier["asked_pages"])
    if isinstance(pool, HackKVPool):
        lays = pool.store.layouts  # one per layer: layers may differ in bits
        codes = sum(lay.k.codes.nbytes + lay.v.codes.nbytes for lay in lays)
        pages = used // page
        tail_per_row = pool.store.nbytes()["tails"] // max(1, pool.store.num_rows)
        out.update(bytes_codes=pages * codes, bytes_side=pages * (pool.store.page_bytes() - codes),
                   bytes_tail=_rows_in_use(scheduler) * tail_per_row)
        totals = getattr(pool, "sparse_totals", None) or getattr(pool, "static_totals", None)
        if totals is not None:  # sparse decode or static eviction: what a step read since the last sample
            prev = getattr(pool, "_sparse_sampled", None) or type(totals)()
            out["pages_selected"], out["pages_visible"] = totals.per_layer_step_since(prev)
            pool._sparse_sampled = copy.copy(totals)
    return out


class TransferLedger:
    """The prompt of each PD request this prefill server will send, noted when it arrives
    (the scheduler knows the prompt and the pool) and taken when its transfer ends (the
    transfer engine's thread knows only the bootstrap room): what the same tokens would have
    cost on the wire from a BF16 KV cache. Bounded: rooms whose transfer never happens
    (aborted while queued) fall out oldest first."""

    MAX_ROOMS = 20000

    def __init__(self) -> None:
        self._rooms: "OrderedDict[int, tuple[int, int]]" = OrderedDict()
        self._lock = threading.Lock()  # noted on the scheduler thread, taken on a transfer thread

    def note(self, room: int, prompt_tokens: int, pool: Any) -> None:
        per_token = pool_bf16_bytes_per_token(pool)
        if per_token <= 0:
            return
        with self._lock:
            self._rooms[int(room)] = (int(prompt_tokens), per_token)
            while len(self._rooms) > self.MAX_ROOMS:
                self._rooms.popitem(last=False)

    def take(self, room: int, skipped_tokens: int = 0) -> tuple[int, int] | None:
        """(tokens sent, their BF16 bytes) for `room`, or None if its prompt was not noted.
        `skipped_tokens`: the prefix the decode server already held (not sent)."""
        with self._lock:
            entry = self._rooms.pop(int(room), None)
        if entry is None:
            return None
        prompt, per_token = entry
        tokens = max(0, prompt - max(0, int(skipped_tokens or 0)))
        return tokens, tokens * per_token


transfers = TransferLedger()
