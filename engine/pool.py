"""HackKVPool: SGLang's token-to-KV pool holding the HACK page layout.

An `MHATokenToKVPool` subclass (returned by the platform's get_kv_pool_cls when the server runs
`--kv-cache-dtype hack`). Its storage is a hack_ops.paged.HackKVStore:
  k_buffer[l], v_buffer[l]  uint8 [num_pages, page_bytes_l]  codes + side tables inline per page
                            (layer l's layout: store.layout_for(l); layers may differ in bits)
                            (SGLang slot s lives in page s // page_size; page 0 is the padding
                            page SGLang reserves for dummy writes)
  store.tails[t][l]         fp16 [rows, Π, H, D]  the open partition of K and/or V, per request row
  store.sink_k/sink_v[l]    fp16 sinks, keyed by a sequence's first page (freed with the page)
The page buffers are plain contiguous tensors per layer so a transfer engine can move whole
pages as opaque bytes (get_contiguous_buf_infos: item = one page). There is no BF16 copy.

Writes go through the attention backend (it knows each token's request row and position);
paths that would read or write this pool as [tokens, heads, head_dim] are refused.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from hack_ops.layout import describe_layouts
from hack_ops.paged import offload
from hack_ops.paged.store import HackKVStore

from . import settings as settings_mod
from .capacity import capacity_report
from .pool_geometry import num_sink_slots, unit_bytes
from .server_state import PoolBuild, state

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def pool_build_context(rows: int, budget: int | None) -> Iterator[None]:
    """Request rows (one FP16 tail each) and the KV budget for a HackKVPool built inside
    (SGLang calls the constructor; this is how the configurator hook reaches it)."""
    st = state()
    st.pool_build = PoolBuild(rows=int(rows), budget=budget)
    try:
        yield
    finally:
        st.pool_build = None


class HackKVPool(MHATokenToKVPool):
    """SGLang KV pool over HACK pages; see the module docstring."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device: str, enable_memory_saver: bool, **kwargs: Any) -> None:
        settings = settings_mod.active()
        if settings is None:
            raise RuntimeError("HackKVPool needs --kv-cache-dtype hack (no HACK settings are published)")
        self.hack_settings = settings
        cfg = settings.config
        if page_size != cfg.partition_size:
            raise ValueError(f"page_size {page_size} != HACK partition size {cfg.partition_size}")
        v_head_dim = kwargs.get("v_head_dim") or head_dim
        if v_head_dim != head_dim:
            raise ValueError(f"HACK needs equal K/V head dims, got {head_dim} and {v_head_dim}")
        for unsupported in ("swa_head_num", "swa_head_dim", "swa_v_head_dim", "quant_method"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"HackKVPool does not support {unsupported}")
        if kwargs.get("post_capture_active"):
            raise ValueError("HackKVPool does not support post-capture KV backing")
        build = state().pool_build
        if build is None:
            raise RuntimeError("HackKVPool must be built inside pool_build_context(rows=...)")
        self._num_rows = build.rows
        self._budget = build.budget
        kwargs["enable_kv_cache_copy"] = False  # the tiled slot-row copy assumes token rows
        super().__init__(size, page_size, dtype, head_num, head_dim, layer_num, device,
                         enable_memory_saver, **kwargs)
        self.capacity_info = capacity_report(unit_bytes(cfg, head_num, head_dim, layer_num), layer_num,
                                             head_num, head_dim, size, self._budget)

    # ---- storage ---------------------------------------------------------------------------
    def _create_buffers(self) -> None:
        self.store_dtype = torch.uint8
        num_pages = (self.size + self.page_size) // self.page_size
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            self.store = HackKVStore(
                self.hack_settings.config, self.layer_num, self.head_num, self.head_dim,
                num_pages=num_pages, num_rows=self._num_rows,
                num_sink_slots=num_sink_slots(self.hack_settings.config, self._num_rows, num_pages),
                device=self.device)
        self.k_buffer = self.store.k_pages
        self.v_buffer = self.store.v_pages
        for name in ("k_scale_buffer", "v_scale_buffer", "native_k_scale_buffer",
                     "native_v_scale_buffer", "dq_k_buffer", "dq_v_buffer"):
            setattr(self, name, None)
        self._kv_buffer_descs = self._build_kv_buffer_descs()
        self._init_data_ptrs_and_strides()

    def _kv_tokens_per_row(self) -> int:
        return self.page_size  # a buffer row is a whole page

    def _build_kv_buffer_descs(self) -> list:
        """One descriptor per buffer (k0..k(L-1), v0..v(L-1)) from that buffer's own shape: the
        base class reads layer 0's shape for all, but layers with other bits
        (--hack-4bit-layers) hold wider pages, and the PD transfer sizes each item from these."""
        from sglang.srt.mem_cache.memory_pool import KvBufferDesc

        return [KvBufferDesc(f"{prefix}{layer}", tuple(buf.shape), row_bytes=buf[0].nbytes,
                             tokens_per_row=self.page_size)
                for prefix, bufs in (("k", self.k_buffer), ("v", self.v_buffer)) for layer, buf in enumerate(bufs)]

    def get_kv_size_bytes(self) -> tuple[int, int]:
        nb = self.store.nbytes()
        half_side = (nb["tails"] + nb["sinks"]) // 2
        k = sum(t.numel() for t in self.store.k_pages) + half_side
        v = sum(t.numel() for t in self.store.v_pages) + half_side
        return k, v

    def local_layer(self, layer_id: int) -> int:
        return layer_id - self.start_layer

    # ---- sink slots follow page lifetimes ------------------------------------------------------
    def on_pages_freed(self, page_ids: tuple) -> None:
        ids = [t.reshape(-1) for t in page_ids if t is not None and t.numel()]
        if ids:
            self.store.free_sinks(torch.cat(ids).cpu())

    def on_all_pages_freed(self) -> None:
        if hasattr(self, "store"):
            self.store.free_sinks(torch.arange(self.store.num_pages))

    # ---- usage ---------------------------------------------------------------------------------
    def usage(self) -> dict:
        nb = self.store.nbytes()
        return {
            "layout": describe_layouts(self.store),
            "num_pages": self.store.num_pages - 1,  # page 0 is SGLang's padding page
            "num_rows": self.store.num_rows,
            "sink_slots_total": self.store.num_sink_slots,
            "sink_slots_in_use": self.store.num_sink_slots - self.store.free_sink_slot_count,
            "bytes": nb,
            "capacity": self.capacity_info if hasattr(self, "capacity_info") else None,
            # sparse decode (set by the attention backend when --hack-sparse-budget is on)
            "sparse": totals.as_dict() if (totals := getattr(self, "sparse_totals", None)) is not None else None,
            # static eviction (set by the attention backend when --hack-static-keep is on)
            "static_keep": st.as_dict() if (st := getattr(self, "static_totals", None)) is not None else None,
        }

    # ---- refused token-row paths -------------------------------------------------------------
    def _refuse(self, what: str):
        raise NotImplementedError(
            f"HackKVPool: {what} is not supported; HACK pages are written and read only by "
            "the 'hack' attention backend")

    def _get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id - self.start_layer]  # raw page bytes, never viewed as K

    def _get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id - self.start_layer]

    def set_kv_buffer(self, *args: Any, **kwargs: Any) -> None:
        self._refuse("set_kv_buffer (token-row writes)")

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        self._refuse("move_kv_cache")

    # ---- a retracted request's state off the pool and back (PD decode's cpu_tensor backup) -------
    def get_cpu_copy(self, indices: torch.Tensor, mamba_indices: Any = None, req_pool_index: Any = None):
        """SGLang copies a request it retracts (its KV token slots, its request row) before freeing
        them: its pages, open-page tail rows and sinks (hack_ops.paged.offload)."""
        if req_pool_index is None:
            self._refuse("CPU offload without the request's row (get_cpu_copy)")
        return offload.save(self.store, indices, int(req_pool_index))

    def load_cpu_copy(self, kv_cache_cpu: Any, indices: torch.Tensor, mamba_indices: Any = None,
                      req_pool_index: Any = None) -> None:
        if req_pool_index is None or not isinstance(kv_cache_cpu, offload.RequestCopy):
            self._refuse("CPU offload of anything but a HACK request copy (load_cpu_copy)")
        offload.load(self.store, kv_cache_cpu, indices, int(req_pool_index))
