"""HackAttnBackend: SGLang's `hack` attention backend, reading HACK pages directly.

Per forward pass, init_forward_metadata builds one plan (page table, new-token positions, sink
slots) from SGLang's req_to_token table; every layer then stores its new K/V into the pool
(quantizing into pages, FP16 tail, sinks) and attends over codes and side tables without a
BF16 copy of the cache. Extend covers prefill, chunked prefill, mixed batches and radix-cache
prefix hits (the prefix pages are simply part of the page table).

Device: the CPU path of hack_ops.paged on CPU; the Triton kernels of hack_ops.triton on CUDA
(engine.gpu_attention). Modes come from the server options: `--hack-prefill auto` (the default)
picks dense or homomorphic for the host (engine.prefill_choice), `--hack-prefill exact` makes the
chunk's own tokens attend to each other in full precision, `--hack-prefill dense` also reads a
cached prefix dequantized once per chunk (prefill only: decode stays on the codes),
`--hack-attention dequant` runs the strawman baseline (same pages, dequantized before
attention at every step).

Rotation (`--hack-rotation`): the layer's q/k/v are rotated here, once, before the store and
attention, and the output is rotated back here, once, after (hack_ops.rotation); every path
below (CPU kernels, Triton, torch, the strawman, exact prefill, the PD transfer of pages and
tails) then works on rotated values unchanged.

Sparse decode (`--hack-sparse-budget`, hack_ops.sparse): a decode step reads, per request and
KV head, the closed pages selected from K's side tables (the first page, the recent ones and the
best-bounded rest up to the budget) through per-head page tables; one SparseDecode per decode
forward carries a selection across the layers that share it. Prefill reads every page; layers
with a sliding window and the first `dense_layers` always do. On a GPU the selection runs on the
device (hack_ops.triton.sparse: the bound alone, no refinement or two levels) and the CUDA or
Triton decode kernel reads its per-head tables.

Static eviction (`--hack-static-keep`, hack_ops.paged.static_keep): after each extend chunk
stores its tokens, every layer without a sliding window decides, from the chunk's last queries,
which of the request's closed pages later decode steps read; decode reads them through the same
per-head page tables as sparse decode. CPU path only (its vote is not built on the GPU path:
refused at startup there); over PD the prefill server's sets travel with the request and its
dropped pages stay off the wire (disagg.static_wire).

Layer features: each layer's sliding window (`sliding_window_size`), scaling and logit
soft-cap go to the attention call. What no HACK path serves (cross-attention, encoder-only or
non-causal layers, MLA) is refused at startup (engine.model_checks), never at a request.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from hack_ops.modes import AttentionMode, PrefillMode
from hack_ops.paged import decode as paged_decode
from hack_ops.paged import extend as paged_extend
from hack_ops.paged import extend_strawman
from hack_ops.paged.chunk_codes import layout_refusal
from hack_ops.paged.cpu_extend import describe as describe_extend_path
from hack_ops.paged.group_boxes import GroupBoxCache
from hack_ops.paged.side_copies import SideTableCopies, copy_bytes, pool_bytes
from hack_ops.paged.sparse import SparseDecode, SparseTotals
from hack_ops.paged.static_keep import StaticKeepPages
from hack_ops.rotation import Rotation, restore_output, rotate_qkv

from . import fused_phases
from .pool import HackKVPool
from .prefill_choice import choose_prefill, dense_dtype

if TYPE_CHECKING:  # pragma: no cover
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)


def _host_list(t: Any) -> list[int]:
    if t is None:
        return []
    if isinstance(t, torch.Tensor):
        return [int(x) for x in t.tolist()]
    return [int(x) for x in t]


class HackAttnBackend(AttentionBackend):
    """Extend and decode on HACK pages; see the module docstring."""

    needs_cpu_seq_lens = True

    def __init__(self, model_runner: Any) -> None:
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, HackKVPool):
            raise ValueError(
                "the 'hack' attention backend needs the HACK KV pool (--kv-cache-dtype hack), "
                f"got {type(pool).__name__}")
        self.pool = pool
        self.store = pool.store
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.device = torch.device(model_runner.device)
        settings = pool.hack_settings
        self.settings = settings
        self.mode: AttentionMode = settings.attention
        # --hack-prefill is a choice of the homomorphic path ('auto' resolved here, where the
        # device and the model's dtype are known); the strawman prefills with extend_strawman
        # (its chunk in full precision, a cached prefix dequantized), which is also what
        # --hack-prefill dense runs.
        model_dtype = getattr(model_runner, "dtype", torch.float32)
        self.prefill, why_prefill = choose_prefill(settings.prefill, settings.attention, self.device.type, model_dtype,
                                                   int8_refusal=layout_refusal(settings.config))
        self.dense_dtype = dense_dtype(self.device.type, model_dtype)  # dense and strawman prefills
        self.rotation: Rotation = settings.config.rotation
        self.generator: Optional[torch.Generator] = None
        if settings.config.rounding == "stochastic":
            # Seeded once per server so a run is reproducible for a fixed request order.
            self.generator = torch.Generator(device="cpu").manual_seed(0)
        # Sparse decode (--hack-sparse-budget): one SparseDecode per decode forward carries the
        # selection across its layers; the totals are what /server_info reports.
        self.sparse = settings.sparse
        self.sparse_totals = SparseTotals()
        self.sparse_step: Optional[SparseDecode] = None
        # two levels (--hack-sparse-groups): each running request's group boxes, kept across steps
        self.group_boxes = GroupBoxCache(self.sparse.group_pages) if self.sparse.group_pages else None
        # one level on the CPU: each running request's K side tables copied in page order, so the
        # selection streams them instead of gathering them from scattered pages (outside the pool)
        # (capped at what copying each pool page once takes: requests sharing a prefix each copy it)
        self.side_copies = (SideTableCopies(pool_bytes(self.store)) if self.sparse.enabled
                            and not self.sparse.group_pages and self.device.type == "cpu" else None)
        pool.sparse_totals = self.sparse_totals if self.sparse.enabled else None
        self.device_selector = None  # on a GPU: the selection on the pages' device
        if self.sparse.enabled and self.device.type == "cuda":
            from hack_ops.triton.sparse import select_on_device

            self.device_selector = select_on_device
            logger.warning("--hack-sparse-budget on a GPU: the selection (a score kernel, then ~20 torch operations "
                           "per layer) is not yet timed on a GPU; its version before, with a host sync, took 1.2-4.2 ms "
                           "per layer on an H200, slower than dense decode (docs/sparse.md, GPU). Sparse decode pays on "
                           "the CPU path; on a GPU, time it first (the CUDA decode benchmark's --sparse-budgets, docs/kernels.md)")
        if self.sparse.enabled and self.device.type == "cuda" and (self.sparse.refine > 1 or self.sparse.group_pages):
            raise NotImplementedError("on a GPU sparse decode selects by the bound alone (hack_ops.triton.sparse): "
                                      "--hack-sparse-refine and --hack-sparse-groups run on the CPU path. Drop them "
                                      "to serve on this GPU")
        # Static eviction (--hack-static-keep): the kept pages of every request row, decided at
        # prefill; its totals are what /server_info reports.
        self.static_keep: Optional[StaticKeepPages] = None
        if settings.static.enabled:
            if self.device.type == "cuda":
                raise NotImplementedError("--hack-static-keep runs on the CPU path: its vote at prefill is not built "
                                          "on the GPU path. Drop the option to serve on this GPU")
            self.static_keep = StaticKeepPages(settings.static, SparseTotals())
        pool.static_totals = self.static_keep.totals if self.static_keep is not None else None
        pool.static_keep = self.static_keep  # PD: the prefill stages its kept sets, the decode installs them
        self.gpu = None
        if self.device.type == "cuda":
            from .gpu_attention import GpuAttention

            self.gpu = GpuAttention(self.store, settings, self.prefill)
        self.forward_metadata = None
        from .model_checks import check_model_layers

        # Per-layer refusal at startup, once the model's layers exist (the config-level check
        # already ran in the launcher); a failure here stops the server before it serves.
        check_model_layers(getattr(model_runner, "model", None), gpu=self.device.type == "cuda",
                           rotation=self.rotation)
        if self.gpu is not None:
            path = ("GPU: Triton store, then dense attention (chunk in full precision, cached prefix dequantized, "
                    "torch SDPA)" if self.prefill == PrefillMode.DENSE else "GPU: Triton homomorphic prefill")
        elif self.mode == AttentionMode.DEQUANT:
            path = f"strawman (chunk in full precision, cached prefix dequantized, torch SDPA{self._sdpa_note()})"
        elif self.prefill == PrefillMode.DENSE:
            path = ("dense (chunk in full precision, cached prefix dequantized once per chunk, torch "
                    f"SDPA{self._sdpa_note()})")
        else:
            path = describe_extend_path(self.store, self.mode, self.generator, self.prefill)
        logger.info("HACK prefill attention path: %s [%s]", path, why_prefill)
        if self.sparse.enabled:
            sp = self.sparse
            logger.info("HACK sparse decode: %d tokens of closed pages per request and KV head (recent %d), "
                        "scored by %s%s%s; layers 0..%d and sliding-window layers read every page; a selection "
                        "serves %d layer(s)", sp.budget_tokens, sp.recent_tokens, sp.score.value,
                        f", refined {sp.refine}x by the candidates' own keys" if sp.refine > 1 else "",
                        f", two levels over groups of {sp.group_pages} pages" if sp.group_pages else "",
                        sp.dense_layers - 1, sp.share_layers)
            if self.side_copies is not None:
                last = self.store.num_layers - 1
                lay, per_page = self.store.layout_for(last), copy_bytes(self.store, last)
                logger.info("HACK sparse decode: each decoding request's K side tables are copied in page order "
                            "beside the pool (%d bytes per page and sparse layer, %.0f%% of a K and V page, outside "
                            "the KV budget, at most %.1f MB: past that a request's are read in its pages; "
                            "/server_info: sparse.copy_bytes)", per_page,
                            100.0 * per_page / (lay.k.page_bytes + lay.v.page_bytes),
                            self.side_copies.max_bytes / 1e6)
        if self.static_keep is not None:
            st = settings.static
            logger.info("HACK static eviction: decode reads %g of each prompt's closed pages per layer (%s unit), "
                        "voted by the prompt's last %g; sliding-window layers read their window", st.keep,
                        st.unit.value, st.observe)

    # ---- plan (once per forward) -----------------------------------------------------------
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if mode.is_target_verify() or mode.is_draft_extend_v2():
            raise NotImplementedError("the 'hack' attention backend does not support speculative decoding")
        rows = _host_list(forward_batch.req_pool_indices)
        seq_lens = _host_list(forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None
                              else forward_batch.seq_lens)
        if mode.is_decode():
            ext_lens = [1] * len(rows)
        else:
            ext_lens = (list(forward_batch.extend_seq_lens_cpu)
                        if forward_batch.extend_seq_lens_cpu is not None
                        else _host_list(forward_batch.extend_seq_lens))
        req_to_token = self.req_to_token_pool.req_to_token
        rids = getattr(forward_batch, "rids", None)
        keys = list(rids) if rids is not None and len(rids) == len(rows) else None  # else the rows key the boxes
        self.sparse_step = (SparseDecode(self.sparse, self.sparse_totals, self.group_boxes, keys,
                                         self.device_selector, self.side_copies)
                            if self.sparse.enabled and mode.is_decode() else None)
        if not mode.is_decode():  # new tokens: those requests' boxes and copies start over
            for cache in (self.group_boxes, self.side_copies):
                if cache is not None:
                    cache.forget(rows, keys)
        if self.gpu is not None:
            self.forward_metadata = self.gpu.plan(req_to_token, rows, seq_lens, ext_lens)
        else:
            plan = self.store.plan(req_to_token, rows, seq_lens, ext_lens)
            self.forward_metadata = plan
            if self.static_keep is not None and not mode.is_decode():
                self.static_keep.begin_extend(plan)
            fused_phases.begin_forward(getattr(forward_batch, "rids", None), ext_lens, seq_lens)

    def init_forward_metadata_out_graph(self, forward_batch: "ForwardBatch", in_capture: bool = False) -> None:
        self.init_forward_metadata(forward_batch)

    # ---- per layer ---------------------------------------------------------------------------
    def _rotated_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention"):
        """q/k/v as [tokens, heads, head_dim], rotated (the one place the rotation is applied)."""
        if layer.qk_head_dim != layer.v_head_dim:
            raise ValueError("the 'hack' backend needs equal q/k and v head dims")
        d = layer.qk_head_dim
        q3 = q.reshape(-1, layer.tp_q_head_num, d)
        k3 = k.reshape(-1, layer.tp_k_head_num, d)
        v3 = v.reshape(-1, layer.tp_v_head_num, d)
        return rotate_qkv(q3, k3, v3, self.rotation)

    def _check_layer(self, layer: "RadixAttention", save_kv_cache: bool, k: Any) -> int:
        if layer.is_cross_attention:  # refused at startup (engine.model_checks); never reached
            raise NotImplementedError("the 'hack' backend does not serve cross-attention layers")
        if not save_kv_cache or k is None:
            raise NotImplementedError("the 'hack' backend stores K/V as it attends; save_kv_cache=False is unsupported")
        if self.forward_metadata is None:
            raise RuntimeError("init_forward_metadata was not called for this forward pass")
        return self.pool.local_layer(layer.layer_id)

    def _sdpa_note(self) -> str:
        return (" in float32: this CPU has no AMX-BF16, where BF16 SDPA runs at about half float32's rate"
                if self.dense_dtype == torch.float32 else "")

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                       forward_batch: "ForwardBatch", save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        lid = self._check_layer(layer, save_kv_cache, k)
        q3, k3, v3 = self._rotated_heads(q, k, v, layer)
        window, cap = layer_features(layer)
        if self.gpu is not None:
            o = self.gpu.extend(lid, self.forward_metadata, q3, k3, v3, layer.scaling,
                                window=window, logit_cap=cap)
        else:
            if self.mode == AttentionMode.DEQUANT:
                # The strawman's prefill as dequantizing systems (KIVI, CacheGen) run it: the new
                # tokens in full precision, a cached prefix dequantized; quantized for storage only.
                o = extend_strawman(self.store, lid, self.forward_metadata, q3, k3, v3, scale=layer.scaling,
                                    generator=self.generator, window=window, logit_cap=cap,
                                    dtype=self.dense_dtype or torch.bfloat16)
            else:
                o = paged_extend(self.store, lid, self.forward_metadata, q3, k3, v3, mode=self.mode,
                                 prefill=self.prefill, scale=layer.scaling, generator=self.generator,
                                 window=window, logit_cap=cap, dense_dtype=self.dense_dtype)
            if self.static_keep is not None and window is None:
                self.static_keep.observe(self.store, lid, self.forward_metadata, q3, layer.scaling, cap)
        return restore_output(o.reshape(q3.shape), self.rotation).reshape(q3.shape[0], -1)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                       forward_batch: "ForwardBatch", save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        lid = self._check_layer(layer, save_kv_cache, k)
        q3, k3, v3 = self._rotated_heads(q, k, v, layer)
        window, cap = layer_features(layer)
        sparse = self.sparse_step if self.sparse_step is not None and self.sparse.layer_is_sparse(lid, window) \
            else None
        if self.gpu is not None:  # the store step, then the selection (when sparse), inside decode
            o = self.gpu.decode(lid, self.forward_metadata, q3, k3, v3, layer.scaling,
                                window=window, logit_cap=cap, sparse=sparse)
        else:  # the store step (HackKVStore.write) runs inside decode
            if self.static_keep is not None and window is None:
                sparse = self.static_keep  # the kept pages, through the sparse decode's page tables
            o = paged_decode(self.store, lid, self.forward_metadata, q3, k3, v3, mode=self.mode,
                             scale=layer.scaling, generator=self.generator, window=window, logit_cap=cap,
                             sparse=sparse)
        return restore_output(o.reshape(q3.shape), self.rotation).reshape(q3.shape[0], -1)

    def support_triton(self) -> bool:
        return self.device.type == "cuda"


def layer_features(layer: Any) -> tuple[Optional[int], float]:
    """(sliding window or None, logit soft-cap or 0.0) of a RadixAttention layer."""
    window = getattr(layer, "sliding_window_size", None)
    cap = getattr(layer, "logit_cap", 0.0) or 0.0
    return (None if window is None or window < 0 else int(window)), float(cap)


