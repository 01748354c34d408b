"""HACK pages on the prefill->decode transfer without their derived bytes (`--hack-kv-codec
hack-pages`, the default of `hack up --kv hack`).

What a plain HACK transfer sends and this one does not (hack_ops.page_wire owns the math):
  - K's code sums (and the alignment padding after the scale section) of the last page of each
    run of pages contiguous on both sides: a run travels as one block that ends at its last page's
    codes | minimum | scale. The other pages' sums ride along (decode overwrites them): a block per
    page saved 2.4% of the bytes, but a 3.2K-token SmolLM2 request became 1,500 K items instead
    of 30, each a round trip of the transfer engine, and under 5% packet loss it took 15.4 s
    instead of 9.3 s (docs/reliability.md). Decode recomputes every received page's sums from its
    codes with the store's own definition, before SGLang's digest check (hook before
    _verify_kv_checksums), so the digest covers the rebuilt pages and a damaged code fails the
    request with "KV checksum mismatch";
  - the open partition's page, when both K and V keep the open partition in FP16 tails (the
    default): decode reads that partition from the tail, which travels as state
    (disagg.pd_state), and quantizes the page itself when it fills. Prefill leaves the page
    out of the last chunk (hook around MooncakeKVManager.add_transfer_request), and both sides
    leave it out of the digest (disagg.checksum via `digest_pages`).
V pages are sent as SGLang sends them (a run of contiguous pages, one block).
Under static eviction (`--hack-static-keep`, disagg.static_wire) the last chunk's indices say,
per layer, which pages travel: a layer's runs are cut around the pages no KV head of it keeps.
Nothing is staged or copied on the prefill side: every block is read straight from the pool.
Both sides append `+hack-pages:<version>` to the KV format string compared at bootstrap, so a
pairing where one side uses the transform and the other does not fails with a sentence.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from .pd_state import buffer_layers
from .transfer_codec import HACK_PAGES_TAG, MAX_BATCH_BLOCKS

logger = logging.getLogger(__name__)

TRANSFORM_VERSION = 1  # bump when the wire form of a page changes


class HackWire:
    """Per scheduler process: which registered buffers are K and V pages and how much of a page
    of each travels; the prefill send and the decode rebuild."""

    def __init__(self, pool: Any, ptrs: list[int], item_lens: list[int]) -> None:
        from hack_ops import page_wire

        self.pool = pool
        self.layouts = pool.store.layouts  # one per layer: layers may differ in bits
        self.page_size = int(pool.page_size)
        self.skip_open = page_wire.open_page_unread(pool.store.config)
        tensors = {int(t.data_ptr()): lay.k for t, lay in zip(pool.k_buffer, self.layouts)}
        tensors.update({int(t.data_ptr()): lay.v for t, lay in zip(pool.v_buffer, self.layouts)})
        layer_of = buffer_layers(pool)
        self.ptrs = [int(p) for p in ptrs]
        self.item_lens = [int(n) for n in item_lens]
        unknown = [p for p in self.ptrs if p not in tensors]
        if unknown:
            raise RuntimeError(f"KV buffer at {unknown[0]:#x} is not one of the pool's K or V page buffers")
        self.wire_lens = [page_wire.wire_bytes(tensors[p]) for p in self.ptrs]
        self.layers = [layer_of[p] for p in self.ptrs]
        for p, item, wire in zip(self.ptrs, self.item_lens, self.wire_lens):
            if wire > item:
                raise RuntimeError(f"KV buffer at {p:#x}: items of {item} B are smaller than a page's wire form ({wire} B)")
        self.lock = threading.Lock()
        self.stats = {"pages": 0, "bytes_in": 0, "bytes_out": 0, "open_pages_skipped": 0, "send_s": 0.0,
                      "rebuild_s": 0.0, "evicted_layer_pages": 0}

    # ---- prefill -----------------------------------------------------------------------------
    def blocks(self, src_pages: list[int], dst_ptrs: list[int], dst_pages: list[int],
               keep: Any = None) -> list[tuple[int, int, int]]:
        """(src address, dst address, length) of every block one chunk's pages travel as.
        keep: bool [layers, pages] or None (static eviction: the pages each layer sends)."""
        out: list[tuple[int, int, int]] = []
        n = min(len(src_pages), len(dst_pages))
        for e in range(len(self.ptrs)):
            item, wire, sbase, dbase = self.item_lens[e], self.wire_lens[e], self.ptrs[e], int(dst_ptrs[e])
            sends = None if keep is None else keep[self.layers[e]]
            i = 0
            while i < n:  # runs of pages contiguous on both sides go as one block
                if sends is not None and not sends[i]:
                    i += 1
                    continue
                j = i + 1
                while (j < n and src_pages[j] == src_pages[j - 1] + 1 and dst_pages[j] == dst_pages[j - 1] + 1
                       and (sends is None or sends[j])):
                    j += 1
                # A K run ends at its last page's scale section; the sums of its other pages ride
                # along (decode rebuilds them all): one block per run, not one per page.
                out.append((sbase + src_pages[i] * item, dbase + dst_pages[i] * item, (j - i - 1) * item + wire))
                i = j
        return out

    def send(self, manager: Any, session_id: str, src_pages: Any, dst_ptrs: list[int], dst_pages: Any) -> int:
        """Send one chunk's pages in their wire form; 0 on success (the transfer engine's convention)."""
        if len(dst_ptrs) != len(self.ptrs):
            logger.error("decode registered %d KV buffers, this prefill sends %d", len(dst_ptrs), len(self.ptrs))
            return -1
        keep = getattr(src_pages, "keep", None)  # static eviction (disagg.static_wire.KeptIndices)
        src = [int(p) for p in src_pages]
        dst = [int(d) for d in dst_pages]
        if keep is not None and keep.shape[1] != len(src):
            keep = None  # no longer lines up with the pages: send them all
        t0 = time.perf_counter()
        blocks = self.blocks(src, dst_ptrs, dst, keep)
        with self.lock:
            self.stats["pages"] += min(len(src), len(dst))
            if keep is not None:
                self.stats["evicted_layer_pages"] += int((~keep[:, :min(len(src), len(dst))]).sum())
            self.stats["bytes_in"] += min(len(src), len(dst)) * sum(self.item_lens)
            self.stats["bytes_out"] += sum(b[2] for b in blocks)
            self.stats["send_s"] += time.perf_counter() - t0
        for i in range(0, len(blocks), MAX_BATCH_BLOCKS):
            ret = manager._transfer_data(session_id, blocks[i:i + MAX_BATCH_BLOCKS])
            if ret != 0:
                return ret
        return 0

    def trim_open_page(self, kv_indices: Any, index_slice: slice, is_last_chunk: bool,
                       num_kv_tokens: int | None) -> tuple[Any, slice]:
        """The last chunk's pages without the open partition's page (when decode does not read
        it). A chunk starts on a page boundary (SGLang delays a partial page to the last
        chunk), so the chunk's open page exists iff its token count is not a multiple of Π."""
        if (not self.skip_open or not is_last_chunk or num_kv_tokens is None
                or num_kv_tokens % self.page_size == 0 or len(kv_indices) == 0):
            return kv_indices, index_slice
        with self.lock:
            self.stats["open_pages_skipped"] += 1
        return kv_indices[:-1], slice(index_slice.start, index_slice.stop - 1, index_slice.step)

    # ---- decode ------------------------------------------------------------------------------
    def rebuild(self, pages: list[int]) -> None:
        """Recompute K's code sums of received pages in place, every layer."""
        from hack_ops import page_wire

        if not pages:
            return
        t0 = time.perf_counter()
        for lay, buf in zip(self.layouts, self.pool.k_buffer):
            page_wire.rebuild_derived(lay, buf, pages)
        with self.lock:
            self.stats["rebuild_s"] += time.perf_counter() - t0

    # ---- both sides: the digest --------------------------------------------------------------
    def digest_pages(self, pages: list[int], live: int) -> list[int]:
        """The pages the digest covers: the open page (the last one when `live` tokens of the
        open partition exist) is not sent, so it is not digested."""
        if self.skip_open and live and pages:
            return pages[:-1]
        return pages


_wire: list[HackWire] = []  # one per scheduler process (set at attach, read by the hooks)


def current() -> HackWire | None:
    return _wire[0] if _wire else None


def fingerprint_tag() -> str:
    return f"{HACK_PAGES_TAG}{TRANSFORM_VERSION}"


def attach(kv_args: Any, pool: Any) -> HackWire:
    """After pd_state.attach: the page buffers this process sends or receives, and the tag."""
    n = len(pool.k_buffer) + len(pool.v_buffer)
    if len(kv_args.kv_data_ptrs) != n:
        raise RuntimeError(f"--hack-kv-codec hack-pages: the pool describes {len(kv_args.kv_data_ptrs)} KV "
                           f"buffers, expected {n} (K and V pages of every layer)")
    wire = HackWire(pool, list(kv_args.kv_data_ptrs), list(kv_args.kv_item_lens)[:n])
    kv_args.kv_cache_dtype_str = f"{kv_args.kv_cache_dtype_str}{fingerprint_tag()}"
    _wire[:] = [wire]
    from hack_ops import page_wire

    logger.info("sglang-hack PD: HACK pages sent without derived bytes (%d of %d B per page, all layers%s); "
                "format %s", sum(page_wire.wire_page_bytes(lay) for lay in wire.layouts),
                wire.pool.store.page_bytes(),
                ", open page not sent" if wire.skip_open else "", kv_args.kv_cache_dtype_str)
    return wire


def around_add_transfer_request(original: Callable, manager: Any, bootstrap_room: int, kv_indices: Any,
                                index_slice: slice, is_last_chunk: bool, *a: Any, **kw: Any) -> Any:
    """AROUND MooncakeKVManager.add_transfer_request (prefill): the last chunk leaves out the
    open partition's page when decode does not read it, and under static eviction says which
    pages each layer sends (disagg.static_wire)."""
    from . import static_wire

    wire = current()
    mask = static_wire.pending.take(bootstrap_room) if is_last_chunk else None
    if wire is not None:
        num = kw.get("num_kv_tokens", a[2] if len(a) > 2 else None)
        kv_indices, index_slice = wire.trim_open_page(kv_indices, index_slice, is_last_chunk, num)
        if mask is not None and len(kv_indices):
            keep = static_wire.chunk_keep(mask, index_slice, len(kv_indices))
            kv_indices = static_wire.KeptIndices.wrap(kv_indices, keep)
    return original(manager, bootstrap_room, kv_indices, index_slice, is_last_chunk, *a, **kw)
