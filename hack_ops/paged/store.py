"""HackKVStore: the paged HACK KV cache of all layers (pages, FP16 tails, FP16 sinks).

Buffers (per layer, all on one device):
  k_pages[l], v_pages[l]  uint8 [num_pages, page_bytes_l] codes + side tables (hack_ops.layout),
                                                          laid out by layout_for(l): layers may
                                                          differ in bits (edge_layer_bits,
                                                          four_bit_layers), hence in page bytes
  tails[name][l]          fp16  [num_rows, Π, H, D]       the open partition of K and/or V
                                                          (layout.tail_tensors: both by
                                                          default), per request row
  sink_k[l], sink_v[l]    fp16  [num_sink_slots, S, H, D] the first S tokens of each sequence
and, shared by all layers, `sink_map` int32 [num_pages]: page id -> sink slot (-1 = none).

Sinks are keyed by the id of the sequence's FIRST page, not by the request row: radix-cache
prefix sharing hands that page (and so its sinks) to every request that shares the prefix,
and the sinks live exactly as long as the page. `ForwardPlan` creation assigns a slot the first
time a sequence writes a position < S; the pool must call `free_sinks(page_ids)` when it
frees pages (freeing a page without a sink slot is a no-op). A page id that is reused without
being freed simply reuses its old slot, which the new sequence overwrites.

A row's tail holds offsets 0..r-1 of its open page, r = seq_len % Π; nothing is zeroed when a
page closes (clearing is logical: the next token overwrites offset 0), and the tail of a
closed page is never read again.

`write` is the one store step of every caller (prefill chunks, decode steps, pages arriving by
transfer, the dequant baseline): it checks the input once (shape, dtype, NaN/inf: nothing is
written on bad input) and runs the cheapest implementation that leaves the same bytes.
"""
from __future__ import annotations

from enum import Enum
from typing import Callable

import torch
from torch import Tensor

from ..config import HackConfig
from ..layout import PageLayout, page_layout
from . import cpu_store
from .plan import ForwardPlan, build_plan
from .write import append_to_tails, appends_only, write_tokens


class StoreBackend(str, Enum):
    """Which implementation HackKVStore.write runs."""

    AUTO = "auto"  # tail append when the plan only appends, else the compiled store when usable, else torch
    TORCH = "torch"  # the PyTorch reference (write.py), every configuration
    CPU = "cpu"  # the compiled store (cpu_store.py), or a clear error


class HackKVStore:
    """The HACK KV cache for `num_layers` layers of `num_heads` KV heads of size `head_dim`."""

    def __init__(
        self,
        config: HackConfig,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        num_pages: int,
        num_rows: int,
        num_sink_slots: int | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_layers <= 0 or num_pages <= 0 or num_rows <= 0:
            raise ValueError(f"num_layers, num_pages and num_rows must be positive, got {num_layers}, {num_pages}, {num_rows}")
        if config.reference_only():
            raise ValueError(f"{', '.join(config.reference_only())} of {config.label()} is implemented in the dense "
                             "reference (hack_ops.attention) only; no paged path stores or reads it")
        self.config = config
        # One layout per layer (config.for_layer): a page id names the same tokens in every
        # layer, only its bytes differ where a layer has other bits.
        self.layouts: list[PageLayout] = _layer_layouts(config, num_layers, num_heads, head_dim)
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.num_rows = num_rows
        self.device = torch.device(device)
        p, s = config.partition_size, config.sink_tokens
        if num_sink_slots is None:
            # Sinks live as long as a sequence's first page; a slot per running row plus one per
            # 16 cached pages covers caches whose sequences average >= 16 pages (1K tokens at Π=64).
            # A cache of shorter sequences runs out first: `reclaim_sink_slots` then evicts
            # cached sequences (the serving engine's radix cache), never a running one.
            num_sink_slots = num_rows + num_pages // 16 if s else 0
        if num_sink_slots < 0:
            raise ValueError(f"num_sink_slots must be >= 0, got {num_sink_slots}")
        self.num_sink_slots = num_sink_slots
        kw = dict(device=self.device)
        self.k_pages = [torch.zeros(num_pages, lay.k.page_bytes, dtype=torch.uint8, **kw) for lay in self.layouts]
        self.v_pages = [torch.zeros(num_pages, lay.v.page_bytes, dtype=torch.uint8, **kw) for lay in self.layouts]
        self.tails: dict[str, list[Tensor]] = {
            name: [torch.zeros(num_rows, p, num_heads, head_dim, dtype=torch.float16, **kw) for _ in range(num_layers)]
            for name in self.layouts[0].tail_tensors
        }
        sink_shape = (num_sink_slots, s, num_heads, head_dim)
        self.sink_k = [torch.zeros(sink_shape, dtype=torch.float16, **kw) for _ in range(num_layers)]
        self.sink_v = [torch.zeros(sink_shape, dtype=torch.float16, **kw) for _ in range(num_layers)]
        self.sink_map = torch.full((num_pages,), -1, dtype=torch.int32, device=self.device)
        self._free_sink_slots: list[int] = list(range(num_sink_slots - 1, -1, -1))
        # Set by the serving engine (engine/sink_reclaim.py): frees cached sequences until `n`
        # sink slots are free (their first pages go back through free_sinks). None: no cache
        # to take from, and running out is the RuntimeError below.
        self.reclaim_sink_slots: Callable[[int], None] | None = None

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.config.partition_size

    @property
    def num_heads(self) -> int:
        return self.layouts[0].num_heads

    @property
    def head_dim(self) -> int:
        return self.layouts[0].head_dim

    @property
    def per_layer(self) -> bool:
        """Layers differ in their page layout (HackConfig.per_layer, resolved over this store's
        layers: edge bits on a one-layer store give that one layer its bits)."""
        return len({id(lay) for lay in self.layouts}) > 1

    def layout_for(self, layer: int) -> PageLayout:
        """The page layout of `layer`."""
        self._check_layer(layer)
        return self.layouts[layer]

    def config_for(self, layer: int) -> HackConfig:
        """The uniform config of `layer` (its bits resolved): what its pages are written with."""
        return self.layout_for(layer).config

    @property
    def layout(self) -> PageLayout:
        """The page layout every layer shares; a ValueError for a store whose layers differ
        (callers that work on one layer ask layout_for(layer))."""
        if self.per_layer:
            raise ValueError(f"the layers of {self.config.label()} differ in page layout: use layout_for(layer)")
        return self.layouts[0]

    def page_bytes(self) -> int:
        """Bytes of one page id over all layers, K and V."""
        return sum(lay.page_bytes for lay in self.layouts)

    def nbytes(self) -> dict:
        """Bytes held per kind of buffer, all layers together."""
        pages = sum(t.numel() for t in self.k_pages) + sum(t.numel() for t in self.v_pages)
        tails = sum(t.numel() * 2 for ts in self.tails.values() for t in ts)
        sinks = sum(t.numel() * 2 for t in self.sink_k) + sum(t.numel() * 2 for t in self.sink_v)
        return {"pages": pages, "tails": tails, "sinks": sinks}

    def tail(self, name: str, layer: int) -> Tensor | None:
        """The FP16 tail of tensor 'k' or 'v' for `layer`, or None if that tensor has none."""
        return self.tails[name][layer] if name in self.tails else None

    # ---- sinks -------------------------------------------------------------------------------
    def sink_slots_for(self, first_pages: Tensor, allocate: bool) -> Tensor:
        """Sink slots of sequences starting at `first_pages` (long [B]); with allocate=True a
        page without a slot gets one (a clear RuntimeError when none is left)."""
        if not self.config.sink_tokens:
            return torch.full(first_pages.shape, -1, dtype=torch.long)
        fp = first_pages.to(torch.long).cpu()
        cur = self.sink_map[fp.to(self.device)].to(torch.long).cpu()
        if allocate:
            missing = torch.nonzero(cur < 0).flatten().tolist()
            for n, i in enumerate(missing):
                page = int(fp[i])
                existing = int(self.sink_map[page])
                if existing >= 0:  # the same first page twice in one batch
                    cur[i] = existing
                    continue
                if not self._free_sink_slots and self.reclaim_sink_slots is not None:
                    self.reclaim_sink_slots(len(missing) - n)
                if not self._free_sink_slots:
                    raise RuntimeError(
                        f"out of sink slots ({self.num_sink_slots}); free the sinks of evicted pages "
                        "with free_sinks() or create the store with a larger num_sink_slots")
                slot = self._free_sink_slots.pop()
                self.sink_map[page] = slot
                cur[i] = slot
        return cur

    def free_sinks(self, page_ids) -> int:
        """Release the sink slots of pages being freed. Returns how many were released."""
        ids = torch.as_tensor(page_ids, dtype=torch.long).flatten()
        if ids.numel() == 0 or not self.config.sink_tokens:
            return 0
        if int(ids.min()) < 0 or int(ids.max()) >= self.num_pages:
            raise ValueError(f"page ids must be in 0..{self.num_pages - 1}")
        ids = torch.unique(ids).to(self.device)
        slots = self.sink_map[ids]
        held = slots >= 0
        released = slots[held].tolist()
        self.sink_map[ids[held]] = -1
        self._free_sink_slots.extend(int(s) for s in released)
        return len(released)

    @property
    def free_sink_slot_count(self) -> int:
        return len(self._free_sink_slots)

    # ---- plan / write ------------------------------------------------------------------------
    def plan(self, req_to_token: Tensor, rows, seq_lens, ext_lens=None) -> ForwardPlan:
        """Batch metadata for one forward pass (call once, use for every layer). ext_lens=None
        means decode (one new token per request). Assigns sink slots to sequences that write
        positions < sink_tokens in this forward."""
        if ext_lens is None:
            ext_lens = torch.ones_like(torch.as_tensor(seq_lens))
        plan = build_plan(req_to_token, rows, seq_lens, ext_lens, self.page_size)
        if int(plan.page_table.max()) >= self.num_pages:
            raise ValueError(f"req_to_token refers to page {int(plan.page_table.max())} but the store has {self.num_pages}")
        if int(plan.rows.max()) >= self.num_rows:
            raise ValueError(f"row {int(plan.rows.max())} is out of range (the store has {self.num_rows} rows)")
        if self.config.sink_tokens:
            writes_sink = plan.prefix_lens < self.config.sink_tokens
            slots = self.sink_slots_for(plan.page_table[:, 0], allocate=False)
            if bool(writes_sink.any()):
                slots[writes_sink] = self.sink_slots_for(plan.page_table[writes_sink, 0], allocate=True)
            if bool((slots < 0).any()):
                bad = torch.nonzero(slots < 0).flatten().tolist()
                raise RuntimeError(f"requests {bad} have cached tokens but their first page has no sinks "
                                   "(was free_sinks called on a page that is still in use?)")
            plan.sink_slot = slots
        plan.appends_only = appends_only(self.config, plan)
        return plan

    def write(self, layer: int, plan: ForwardPlan, k: Tensor, v: Tensor, generator: torch.Generator | None = None,
              backend: StoreBackend | str = StoreBackend.AUTO) -> None:
        """Store the new tokens' K and V ([N, H, D], N = plan.num_new_tokens) of one layer.

        backend 'auto': a plan whose tokens only append to FP16 tails (most decode steps) is one
        compiled call on the CPU (cpu_store.append_tails; else two index writes); otherwise the
        compiled store when it covers the configuration (cpu_store.why_not), else the PyTorch
        reference. All leave the same bytes (tested)."""
        self._check_layer(layer)
        backend = backend if type(backend) is StoreBackend else StoreBackend(backend)
        if backend == StoreBackend.AUTO and self.device.type == "cpu" and self._appends_only(plan):
            self._check_kv(plan, k, v, finite=False)
            if not cpu_store.append_tails(self, layer, plan, k, v):  # (checks finiteness itself)
                self._check_kv(plan, k, v)
                append_to_tails(self, layer, plan, k, v)
            return
        self._check_kv(plan, k, v)
        if backend == StoreBackend.TORCH:
            write_tokens(self, layer, plan, k, v, generator)
            return
        if backend == StoreBackend.CPU:
            why = cpu_store.why_not(self, generator)
            if why is not None:
                raise RuntimeError(f"the compiled store is not usable here: {why}")
            cpu_store.write(self, layer, plan, k, v)
        elif self._appends_only(plan):
            append_to_tails(self, layer, plan, k, v)
        elif cpu_store.why_not(self, generator) is None:
            cpu_store.write(self, layer, plan, k, v)
        else:
            write_tokens(self, layer, plan, k, v, generator)

    def _appends_only(self, plan: ForwardPlan) -> bool:
        if plan.appends_only is None:  # a plan not made by this store's plan()
            plan.appends_only = appends_only(self.config, plan)
        return plan.appends_only

    def _check_kv(self, plan: ForwardPlan, k: Tensor, v: Tensor, finite: bool = True) -> None:
        """The store step's input checks, once for every implementation (finite=False: all but
        finiteness, which the compiled tail append checks itself)."""
        shape = (plan.num_new_tokens, self.num_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, Tensor) or not t.is_floating_point():
                raise ValueError(f"{name} must be a floating-point tensor")
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must be [new_tokens, heads, head_dim] = {shape}, got {tuple(t.shape)}")
            if finite and t.numel() and not _all_finite(t):
                raise ValueError(f"{name} contains NaN or inf; nothing was written")

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in 0..{self.num_layers - 1}, got {layer!r}")


def _layer_layouts(config: HackConfig, num_layers: int, num_heads: int, head_dim: int) -> list[PageLayout]:
    """Each layer's layout; layers with the same resolved config share one object."""
    cache: dict[HackConfig, PageLayout] = {}
    out = []
    for layer in range(num_layers):
        cfg = config.for_layer(layer, num_layers)
        if cfg not in cache:
            cache[cfg] = page_layout(cfg, num_heads, head_dim)
        out.append(cache[cfg])
    return out


def _all_finite(t: Tensor) -> bool:
    """Whether t holds no NaN or inf: its minimum and maximum are finite (a NaN anywhere makes
    both NaN). One reduction, ~20x faster than isfinite().all() on BF16 input, where that check
    cost a 2K-token prompt about an eighth of its page store."""
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))

