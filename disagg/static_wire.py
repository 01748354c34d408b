"""Static eviction over PD (`--hack-static-keep` on both servers): the prefill server decides
each request's kept pages (hack_ops.paged.static_keep), leaves the dropped ones of each layer off
the wire, and sends the kept set beside the request's other per-row state; the decode server
installs it before the first step, so its decode reads only pages that arrived.

The kept set travels in two per-row buffers (one REQUEST_ROW state component, as the sinks do):
  meta  int32 [rows, 1 + L]: the prompt's closed pages the set covers, then per layer the pages
        each KV head keeps (-1: the layer has no set and reads every page, e.g. a sliding-window
        layer, or a request whose prompt holds no closed page);
  bits  uint8 [rows, L, H', W]: bit i of a head's bytes = prompt page i kept (H' = 1 when the unit
        is the page, one row per KV head otherwise; W = ceil(max pages of a request / 8)).
Every request's row is written at its last chunk, a request without a set included, so a row
never carries an earlier request's set. What the wire leaves out: a layer's page that no KV head
of that layer keeps, among the pages of the last chunk (SGLang sends the earlier chunks of a long
prompt while later ones are still prefilling, before the set exists; those go whole), with
`--hack-kv-codec hack-pages` (disagg.hack_wire: the blocks are cut per layer). Other codecs send
every page; decode still reads only the kept ones.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hack_ops.paged.static_keep import KeptPages
from hack_ops.static_keep import KeepUnit

logger = logging.getLogger(__name__)


@dataclass
class KeptStaging:
    """The two per-row buffers (module docstring)."""

    meta: torch.Tensor
    bits: torch.Tensor
    heads: int  # KV heads of the store (H' is 1 or this)

    @classmethod
    def for_store(cls, store: Any, unit: KeepUnit, max_pages: int) -> "KeptStaging":
        h = 1 if KeepUnit(unit) == KeepUnit.PAGE else store.num_heads
        w = max(1, -(-int(max_pages) // 8))
        meta = torch.full((store.num_rows, 1 + store.num_layers), -1, dtype=torch.int32)
        bits = torch.zeros(store.num_rows, store.num_layers, h, w, dtype=torch.uint8)
        return cls(meta=meta, bits=bits, heads=store.num_heads)

    @property
    def max_pages(self) -> int:
        return self.bits.shape[-1] * 8

    def buffers(self) -> list[torch.Tensor]:
        return [self.meta, self.bits]

    def stage(self, row: int, kept: KeptPages | None) -> None:
        """Write row's kept set (None: no set, every page read)."""
        self.meta[row] = -1
        self.bits[row] = 0
        if kept is None:
            return
        if kept.prompt_pages > self.max_pages:
            raise ValueError(f"a kept set of {kept.prompt_pages} pages does not fit the {self.max_pages} the "
                             "staging row holds")
        self.meta[row, 0] = kept.prompt_pages
        h = self.bits.shape[2]
        for layer, pos in kept.positions.items():
            self.meta[row, 1 + layer] = pos.shape[1]
            flags = torch.zeros(h, self.max_pages, dtype=torch.bool)
            flags.scatter_(1, pos[:h].to(torch.long), True)
            self.bits[row, layer] = _pack(flags)

    def read(self, row: int) -> KeptPages | None:
        """Row's kept set as staged (prefill) or received (decode); None: no set."""
        prompt = int(self.meta[row, 0])
        if prompt < 0:
            return None
        kept = KeptPages(prompt_pages=prompt)
        for layer in range(self.bits.shape[1]):
            count = int(self.meta[row, 1 + layer])
            if count < 0:
                continue
            flags = _unpack(self.bits[row, layer])[:, :prompt]
            pos = flags.nonzero()[:, 1].reshape(flags.shape[0], -1)
            if pos.shape[1] != count:
                raise ValueError(f"the kept set of layer {layer} lists {pos.shape[1]} pages, its count says {count}")
            kept.positions[layer] = pos.expand(self.heads, -1).clone() if pos.shape[0] == 1 else pos
        return kept


def _pack(flags: torch.Tensor) -> torch.Tensor:
    """bool [..., 8 W] -> uint8 [..., W], bit j of byte i = flags[8 i + j]."""
    w = flags.shape[-1] // 8
    weights = (1 << torch.arange(8, dtype=torch.int32))
    return (flags.reshape(*flags.shape[:-1], w, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def _unpack(bits: torch.Tensor) -> torch.Tensor:
    return ((bits.to(torch.int32)[..., None] >> torch.arange(8, dtype=torch.int32)) & 1).bool().flatten(-2)


class KeptIndices(np.ndarray):
    """A chunk's page indices that also say, per layer, which of them travel (`keep`, bool
    [L, n]); SGLang's transfer queue hands the array to send_kvcache as it is."""

    keep: np.ndarray | None = None

    @classmethod
    def wrap(cls, indices: Any, keep: np.ndarray) -> "KeptIndices":
        out = np.asarray(indices).view(cls)
        out.keep = keep
        return out

    def __array_finalize__(self, obj: Any) -> None:
        # a slice or copy of a wrapped array no longer lines up with `keep`: it sends every page
        self.keep = None


class PendingMasks:
    """Prefill: each request's page mask from its last chunk's staging until its transfer
    request is queued (bounded: a request aborted in between falls out oldest first)."""

    MAX = 4096

    def __init__(self) -> None:
        self._masks: "OrderedDict[int, torch.Tensor]" = OrderedDict()
        self._lock = threading.Lock()

    def put(self, room: int, mask: torch.Tensor | None) -> None:
        with self._lock:
            if mask is None:
                self._masks.pop(int(room), None)
                return
            self._masks[int(room)] = mask
            while len(self._masks) > self.MAX:
                self._masks.popitem(last=False)

    def take(self, room: int | None) -> torch.Tensor | None:
        if room is None:
            return None
        with self._lock:
            return self._masks.pop(int(room), None)


pending = PendingMasks()


def chunk_keep(mask: torch.Tensor, index_slice: slice, n: int) -> np.ndarray:
    """bool [L, n]: which of a chunk's n pages (page positions index_slice.start + i) each layer
    sends: the kept ones among the prompt's closed pages, every page past them."""
    start = int(index_slice.start or 0)
    out = np.ones((mask.shape[0], n), dtype=bool)
    covered = max(0, min(n, mask.shape[1] - start))
    if covered:
        out[:, :covered] = mask[:, start:start + covered].numpy()
    return out


# ---- the connector's calls (one pool per scheduler process) ------------------------------------

_active: list[tuple[KeptStaging, dict[int, int], int]] = []  # (staging, layer of each KV buffer address, layers)


def activate(staging: KeptStaging, layer_of: dict[int, int]) -> None:
    """At attach (disagg.pd_state), once the staging rows exist: the layer each K/V page
    buffer holds, by address (pd_state.buffer_layers)."""
    _active[:] = [(staging, dict(layer_of), staging.bits.shape[1])]


def current() -> tuple[KeptStaging, dict[int, int], int] | None:
    return _active[0] if _active else None


def stage_for_send(pool: Any, row: int, room: int | None) -> None:
    """Prefill, before the last chunk: row's kept set into its staging row (every request's,
    a request without a set included) and its page mask for the chunk's send."""
    staging = getattr(pool, "disagg_kept_staging", None)
    keeper = getattr(pool, "static_keep", None)
    if staging is None or keeper is None:
        return
    kept = keeper.kept(row)
    staging.stage(row, kept)
    if room is not None:
        pending.put(room, None if kept is None else kept.page_mask(staging.bits.shape[1]))


def install_received(pool: Any, row: int, rid: Any = "?") -> None:
    """Decode, once the transfer landed: the received kept set becomes row's. A set that does
    not decode (a damaged row) reads every page and says so."""
    staging = getattr(pool, "disagg_kept_staging", None)
    keeper = getattr(pool, "static_keep", None)
    if staging is None or keeper is None:
        return
    try:
        kept = staging.read(row)
    except ValueError as exc:
        logger.error("request %s: its kept set did not arrive whole (%s); it reads every page", rid, exc)
        kept = None
    keeper.install(row, kept)


def digest_filter(state_indices: Any, kv_page_indices: Any) -> dict[int, list[int]] | None:
    """The pages each K/V buffer's digest covers under static eviction, by buffer address (the
    pages its layer sent: kept ones among the prompt's, every later one), read from the
    request's staging row on either side; None when every buffer covers every page."""
    got = current()
    row = getattr(state_indices, "row", None)
    if got is None or row is None or kv_page_indices is None:
        return None
    staging, layer_of, layers = got
    try:
        kept = staging.read(int(row))
    except ValueError:
        return None  # a damaged row: digest every page, which fails the request as it should
    if kept is None:
        return None
    pages = [int(x) for x in (kv_page_indices.tolist() if hasattr(kv_page_indices, "tolist") else kv_page_indices)]
    keep = chunk_keep(kept.page_mask(layers), slice(0, len(pages)), len(pages))
    per_layer = [[p for p, k in zip(pages, keep[layer]) if k] for layer in range(layers)]
    return {ptr: per_layer[layer] for ptr, layer in layer_of.items()}
