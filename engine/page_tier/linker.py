"""PageTierLinker: SGLang's unified radix cache linked to a page store on disk (the page tier).

SGLang's UnifiedRadixCache drives an external KV store through a `UnifiedCacheLinker`
(sglang.srt.mem_cache.unified_cache.unified_cache_linker): the tree offloads every node it
inserts (write-through; keys are SGLang's per-page hash chain), asks `lookup` how much of an
uncached prefix the store can restore, has the request's new slots filled by `load`, and
inserts the restored pages like computed KV after the forward. This linker is that interface
over SGLang's `HiCacheFile` storage backend (`HiCacheStorage.set/get/exists`, LRU-capped on
disk), for HACK pages (codes, side tables, code sums, and a first page's sinks) and, for the
baseline, SGLang's own BF16 token pages (engine.page_tier.page_bytes).

Why not SGLang's HiCache host pool: on a CPU-only host its host pool registers memory with CUDA
(`pool_host.common.alloc_with_host_register`) and its controller moves pages with CUDA streams
and kernels; the linker path needs neither, and every page of it goes through code we test.

Every record is verified in `lookup` (size, header, digest; a first page's sinks too) before a
hit is reported, so a damaged or missing record shortens the hit and the rest is recomputed;
verified records wait in a bounded cache for `load`, so a file evicted in between costs nothing.
Loads run in the scheduler thread when the batch starts (the pages are in the pool before its
forward); writes are snapshotted in the scheduler thread and written to disk by one thread.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker

from .page_bytes import FLAG_FIRST_PAGE, SINK_SUFFIX, DamagedRecord, page_format, seal, sealed_size, unseal

logger = logging.getLogger(__name__)

# Verified records kept between lookup and load (a request's hit is read once, not per match).
_CACHE_BYTES = 256 << 20
_DISK_SCAN_S = 5.0  # the directory is scanned at least this often (the LRU cap removes files)
_DISK_RESCAN_S = 1.0  # and after writes, at most this often (a large tier is many files)


def _entry_bytes(entry: tuple[torch.Tensor, Optional[torch.Tensor]]) -> int:
    page, sinks = entry
    return page.numel() + (sinks.numel() if sinks is not None else 0)


@dataclass
class TierStats:
    """Counters of one server's page tier (reported in /server_info: internal_states[].hack_kv)."""

    lookups: int = 0
    asked_pages: int = 0  # uncached pages lookups asked about
    hit_pages: int = 0  # of those, the pages found restorable (verified)
    loaded_pages: int = 0  # pages written into the pool
    loaded_requests: int = 0
    refused_records: int = 0  # damaged, truncated or missing-sink records: recomputed instead
    failed_loads: int = 0  # loads that could not complete (their requests were aborted by SGLang)
    offloaded_pages: int = 0
    failed_offloads: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


class PageTierLinker(UnifiedCacheLinker):
    """See the module docstring. Built by SGLang's `dynamic` linker backend (`--hack-page-tier`)."""

    def __init__(self, server_args: Any, params: Any, *, components: Any, extra_config: Optional[dict] = None,
                 forward_stream: Any = None) -> None:
        from sglang.srt.runtime_context import get_model

        cfg = dict(extra_config or {})
        path = cfg.get("path")
        if not path:
            raise ValueError("the page tier needs a directory (--hack-page-tier DIR)")
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        pool = params.token_to_kv_pool_allocator.get_kvcache()
        model = get_model().model_path
        self.format = page_format(pool, model)
        self.pools = {PoolName.KV: pool}
        self.num_layers = int(pool.layer_num)
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        os.makedirs(path, exist_ok=True)
        storage_cfg = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=True, model_name=self.format.namespace,
            extra_config={"file_storage_path": path, **({"max_size": cfg["max_size"]} if cfg.get("max_size") else {})})
        self.storage = HiCacheFile(storage_cfg, file_path=path)
        self.path = path
        self.stats = TierStats()
        self._page_record = sealed_size(self.format.page_bytes)
        self._sink_record = sealed_size(self.format.sink_bytes) if self.format.sink_bytes else 0
        self._verified: OrderedDict[str, tuple[torch.Tensor, Optional[torch.Tensor]]] = OrderedDict()
        self._verified_bytes = 0
        self._pending: dict[str, PoolTransfer] = {}
        self._disk: tuple[int, int] = (0, 0)  # files and bytes on disk at the last scan
        self._disk_at = float("-inf")  # when it was taken
        self._disk_gen = 0  # writes so far (the scan is reused only while none came since)
        self._disk_seen = -1
        self._writes: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="hack-page-tier-writer")
        self._writer.start()
        logger.info("sglang-hack: page tier at %s (%s, %d bytes a page, cap %s)", path, self.format.namespace,
                    self._page_record, cfg.get("max_size") or "none")
        if self.page_size < 16:
            logger.warning("sglang-hack: the page tier writes one file per %d-token page; with --page-size 64 "
                           "a record holds 64 tokens and a restore reads 64x fewer files", self.page_size)

    # ---- lookup: how many of the uncached pages the store restores, verified ---------------------
    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        keys = self._kv(transfers).keys or []
        self.stats.lookups += 1
        self.stats.asked_pages += len(keys)
        n = 0
        for key in keys:
            if self._verify(key) is None:
                break
            n += 1
        self.stats.hit_pages += n
        return list(range(1, n + 1))

    def _verify(self, key: str) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """The verified payloads (page, sinks or None) stored under `key`, or None."""
        hit = self._verified.get(key)
        if hit is not None:
            self._verified.move_to_end(key)
            return hit
        if not self.storage.exists(key):
            return None
        page, flags = self._read(key, self._page_record, self.format.page_bytes)
        if page is None:
            return None
        sinks = None
        if flags & FLAG_FIRST_PAGE:
            if not self._sink_record:
                self._refuse(key, "a first page in a format without sinks")
                return None
            sinks, _ = self._read(key + SINK_SUFFIX, self._sink_record, self.format.sink_bytes)
            if sinks is None:
                self._discard(key + SINK_SUFFIX)
                return self._refuse(key, "its sinks are missing or damaged")
        entry = (page, sinks)
        self._verified[key] = entry
        self._verified_bytes += _entry_bytes(entry)
        while self._verified_bytes > _CACHE_BYTES and len(self._verified) > 1:
            self._forget(next(iter(self._verified)))  # the least recently verified
        return entry

    def _forget(self, key: str) -> None:
        entry = self._verified.pop(key, None)
        if entry is not None:
            self._verified_bytes -= _entry_bytes(entry)

    def _read(self, key: str, record_bytes: int, payload_bytes: int) -> tuple[Optional[torch.Tensor], int]:
        buf = torch.empty(record_bytes, dtype=torch.uint8)
        try:
            got = self.storage.get(key, buf)
        except (OSError, ValueError) as exc:  # a short (truncated) file raises IOError
            self._refuse(key, str(exc))
            return None, 0
        if got is None:
            return None, 0
        self.stats.bytes_read += record_bytes
        try:
            payload, flags = unseal(key, buf, payload_bytes)
        except DamagedRecord as exc:
            self._refuse(key, str(exc))
            return None, 0
        return payload, flags

    def _refuse(self, key: str, why: str) -> None:
        """Count and log a record that is not served, and remove it: the next offload of the same
        page (after its recompute) writes it again instead of skipping an existing key."""
        self.stats.refused_records += 1
        logger.warning("sglang-hack: page tier record %s refused (%s); its tokens are recomputed", key[:16], why)
        self._discard(key)
        return None

    def _discard(self, key: str) -> None:
        # HiCacheStorage has no delete; HiCacheFile's file name is its suffixed key (its LRU
        # evictor drops an entry whose file is already gone).
        try:
            os.remove(os.path.join(self.path, f"{self.storage._get_suffixed_key(key)}.bin"))
            self._disk_gen += 1
        except FileNotFoundError:
            pass
        except OSError as exc:  # it stays refused at every lookup; serving goes on
            logger.warning("sglang-hack: page tier record %s could not be removed: %s", key[:16], exc)

    # ---- load: verified pages into the request's new slots, when its batch starts ----------------
    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        kv = self._kv(transfers)
        if kv.device_indices is None or not kv.keys:
            return False
        if rid in self._pending:
            raise RuntimeError(f"page tier: a load for {rid} is already queued")
        self._pending[rid] = kv
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        return self._pending.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        if not self._pending:
            return -1
        pending, self._pending = self._pending, {}
        index = self.layer_done_counter.update_producer()
        try:
            for kv in pending.values():
                self._load_one(kv)
        except Exception as exc:  # a record gone bad since lookup: SGLang aborts these requests
            self.stats.failed_loads += 1
            logger.exception("sglang-hack: page tier load failed")
            self.layer_done_counter.fail(index, exc)
            return index
        for layer in range(self.num_layers):
            self.layer_done_counter.complete(index, layer)
        return index

    def _load_one(self, kv: PoolTransfer) -> None:
        slots = kv.device_indices.reshape(-1).cpu()
        pages = (slots[::self.page_size] // self.page_size).tolist()
        if len(pages) != len(kv.keys):
            raise ValueError(f"{len(kv.keys)} keys for {len(pages)} pages")
        for key, page in zip(kv.keys, pages):
            entry = self._verify(key)
            if entry is None:
                raise DamagedRecord(f"record {key[:16]} is no longer in the store")
            payload, sinks = entry
            self.format.write_page(page, payload)
            if sinks is not None:
                self.format.write_sinks(page, sinks)
            self._forget(key)
        self.stats.loaded_pages += len(pages)
        self.stats.loaded_requests += 1

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    # ---- offload: pages snapshotted now, written by the writer thread ----------------------------
    def offload(self, transfers: list[PoolTransfer], session_id: Optional[str] = None) -> bool:
        kv = self._kv(transfers)
        if kv.device_indices is None or not kv.keys:
            return False
        slots = kv.device_indices.reshape(-1).cpu()
        pages = (slots[::self.page_size] // self.page_size).tolist()
        if len(pages) != len(kv.keys):
            return False
        records = []
        for key, page in zip(kv.keys, pages):
            if self.storage.exists(key):
                continue
            first = self.format.first_page(page)
            if first:  # sinks first: a page on disk whose sinks are not is refused at lookup anyway
                records.append((key + SINK_SUFFIX, seal(key + SINK_SUFFIX, self.format.read_sinks(page))))
            records.append((key, seal(key, self.format.read_page(page), FLAG_FIRST_PAGE if first else 0)))
        self._writes.put(records)
        return True

    def _write_loop(self) -> None:
        while True:
            records = self._writes.get()
            if records is None:
                self._writes.task_done()
                return
            ok = True
            try:
                for key, record in records:
                    if self.storage.set(key, record):
                        self._disk_gen += 1  # the next report rescans (bumped before the counters move)
                        self.stats.bytes_written += record.numel()
                        if not key.endswith(SINK_SUFFIX):
                            self.stats.offloaded_pages += 1
                    else:
                        ok = False
            except Exception:
                logger.exception("sglang-hack: page tier write failed")
                ok = False
            if not ok:
                self.stats.failed_offloads += 1
            self._results.put(ok)
            self._writes.task_done()

    def num_completed_offloads(self) -> int:
        return self._results.qsize()

    def pop_completed_offload(self) -> bool:
        return self._results.get_nowait()

    # ---- lifecycle ---------------------------------------------------------------------------
    def reset(self) -> None:
        self._pending.clear()
        self._writes.join()
        while not self._results.empty():
            self._results.get_nowait()
        self._verified.clear()
        self._verified_bytes = 0
        self.layer_done_counter.reset()

    def close(self) -> None:
        self.reset()
        self._writes.put(None)
        self._writer.join(timeout=30)
        logger.info("sglang-hack: page tier stats %s", asdict(self.stats))

    def report(self) -> dict:
        """Counters and the store's size on disk, for /server_info and the metrics sampler (the
        directory is rescanned at most once a second after writes, else every few seconds)."""
        now, gen = time.monotonic(), self._disk_gen
        age = now - self._disk_at
        if (gen != self._disk_seen and age >= _DISK_RESCAN_S) or age > _DISK_SCAN_S:
            self._disk, self._disk_at, self._disk_seen = self._scan(), now, gen
        files, size = self._disk
        asked = self.stats.asked_pages
        return {"path": self.path, "namespace": self.format.namespace, "page_size": self.page_size,
                "record_bytes": self._page_record, "files": files, "bytes_on_disk": size, **asdict(self.stats),
                "restored_tokens": self.stats.loaded_pages * self.page_size,
                "hit_rate": (self.stats.hit_pages / asked) if asked else None}

    def _scan(self) -> tuple[int, int]:
        suffix = f"_{self.format.namespace}_0_1.bin"
        files = size = 0
        try:
            with os.scandir(self.path) as it:
                for entry in it:
                    if entry.name.endswith(suffix) and not entry.name.startswith("."):
                        files += 1
                        size += entry.stat().st_size
        except FileNotFoundError:
            pass
        return files, size

    def drain(self) -> None:
        """Wait until every queued write is on disk (tests, benchmarks); the next report rescans."""
        self._writes.join()
        self._disk_at = float("-inf")

    @staticmethod
    def _kv(transfers: list[PoolTransfer]) -> PoolTransfer:
        for t in transfers:
            if t.name == PoolName.KV:
                return t
        raise ValueError("the page tier stores the KV pool; no KV transfer was given")
