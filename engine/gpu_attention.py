"""GPU path of the `hack` backend: hack_ops.cuda and hack_ops.triton kernels on the pool's own buffers.

The plan is the same HackKVStore.plan the CPU path uses (page table, request rows, sink slots,
all checks), turned into the CSR page table the kernels take (ForwardPlan.csr_pages). Per layer: decode stores
the new token (store kernel) then runs the decode kernel chosen at startup (engine.decode_choice):
the CUDA kernel (hack_ops.cuda.CudaDecodeAttention) on the layers it reads, else, and on every
layer where it cannot run, the Triton HackDecodeAttention; a CUDA build that fails at a layer's
first call (a soft-capping variant, say) moves that layer to Triton with a logged warning. Both
take the same plan and cache. Extend runs HackPrefillAttention,
which stores the chunk's pages, attends, then appends the tails (PrefillMode.HOMOMORPHIC), or
(PrefillMode.DENSE) stores the chunk with the store kernel and attends densely: the chunk's
own tokens in full precision, a cached prefix dequantized once per chunk, torch SDPA
(hack_ops.paged.attention.dense_attend, the CPU path's dense prefill); where the CUDA kernels were
chosen, the chunk's pages come from the CUDA store (hack_ops.cuda.store, same bytes). Each call takes the layer's
scaling, sliding window and logit soft-cap (engine.backend.layer_features) and its own page
layout (store.layout_for: layers may differ in bits, K's and V's apart); the kernels skip the
pages before the window. Sparse decode (a SparseDecode given to decode): after the store step the
selection runs on the device (hack_ops.triton.sparse, the bound alone) and the layer's kernel,
CUDA or Triton as for dense, is planned on its per-KV-head page tables.

The project's CI machine has no GPU. What can be checked there is checked: the format is
accepted by kernel_spec at startup, the plan conversion is pure torch, the Triton kernels run on
CPU tensors in Triton's interpreter (tests/test_triton_prefill.py), and the CUDA kernel's source
runs on the CPU in its fiber harness (tests/test_cuda_simt.py). Formats the Triton kernels do not
implement are refused when the server starts.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from hack_ops.cuda.spec import ACT_DTYPES, DecodeKernel, layout_why_not
from hack_ops.modes import AttentionMode, PrefillMode
from hack_ops.paged.plan import ForwardPlan
from hack_ops.paged.sparse import SparseDecode

from .decode_choice import choose_decode_kernel, decode_kernel_from_env

logger = logging.getLogger(__name__)


class GpuAttention:
    def __init__(self, store: Any, settings: Any, prefill: PrefillMode = PrefillMode.HOMOMORPHIC) -> None:
        """prefill: the server's resolved PrefillMode (engine.prefill_choice; 'auto' is dense
        on a GPU): homomorphic or dense; exact is refused here, at startup."""
        from hack_ops.triton.spec import kernel_spec

        if settings.attention != AttentionMode.HACK:
            raise NotImplementedError("--hack-attention dequant runs on the CPU path only")
        if prefill not in (PrefillMode.HOMOMORPHIC, PrefillMode.DENSE):
            raise NotImplementedError(f"--hack-prefill {prefill.value} runs on the CPU path only; on a GPU use "
                                      "dense or homomorphic")
        self.prefill = prefill
        for lay in {id(lay): lay for lay in store.layouts}.values():
            kernel_spec(lay)  # refuses formats the kernels do not implement, with the reason
        self.store = store
        self.device = store.device
        # Planned kernels by (query heads, the layer's K bits, its V bits): layers with more bits
        # (--hack-4bit-layers, for K alone or K and V) have their own page layout, hence their
        # own kernel object.
        self._decode: dict[tuple[int, int, int], Any] = {}
        self._prefill: dict[tuple[int, int, int], Any] = {}
        self._csr: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None = None
        self.decode_kernel, why = choose_decode_kernel(self.device, decode_kernel_from_env())
        logger.info("HACK decode attention kernel: %s [%s]", self.decode_kernel.value, why)
        self._on_triton: dict[tuple[int, int, int], str] = {}  # layer formats the CUDA kernel does not take, and why
        self._store_on_triton: dict[tuple, str] = {}  # (K bits, V bits, dtype) the CUDA store does not write, and why
        if self.decode_kernel == DecodeKernel.CUDA and self.device.type == "cuda":
            self.prepare_store()

    def plan(self, req_to_token: Tensor, rows: list[int], seq_lens: list[int], ext_lens: list[int]) -> ForwardPlan:
        plan = self.store.plan(req_to_token, rows, seq_lens, ext_lens)
        indptr, indices = plan.csr_pages(self.device)
        self._csr = (indptr, indices, plan.seq_lens.to(self.device), plan.qo_indptr.to(self.device),
                     plan.rows.to(self.device))
        self._decode.clear()
        self._prefill.clear()
        return plan

    def _cache(self, layer: int) -> tuple:
        s = self.store
        return (s.k_pages[layer], s.v_pages[layer], s.tail("k", layer), s.tail("v", layer),
                s.sink_k[layer] if s.config.sink_tokens else None,
                s.sink_v[layer] if s.config.sink_tokens else None)

    def decode(self, layer: int, plan: ForwardPlan, q: Tensor, k: Tensor, v: Tensor,
               scale: float, window: int | None = None, logit_cap: float = 0.0,
               sparse: SparseDecode | None = None) -> Tensor:
        """One layer's decode step: the new token stored, then attention over every page, or
        (sparse, hack_ops.paged.sparse.SparseDecode selecting on the device) over each KV head's
        selected pages, through a kernel planned on the selection's per-head tables."""
        from hack_ops.triton.store import store as store_tokens

        indptr, indices, lens = self._csr[:3]
        hq, lay = q.shape[1], self.store.layout_for(layer)
        key = (hq, lay.config.bits("k"), lay.config.bits("v"))
        attn = self._decode.get(key)
        if attn is None:
            attn = self._planned(key, lay, hq, q, scale, (indptr, indices, lens), plan)
            self._decode[key] = attn
        attn.sm_scale = float(scale)
        cache = self._cache(layer)
        store_tokens(lay, attn.batch, k.contiguous(), v.contiguous(), *cache, phase="all")
        sel = sparse.select(self.store, layer, plan, q) if sparse is not None else None
        tables = None
        if sel is not None:  # a kernel of this layer's own selection (the dense one stays planned)
            s_indptr, s_indices = sel.head_csr()
            tables = (s_indptr, s_indices, sel.seq_lens.to(device=self.device, dtype=torch.int32))
            attn = self._planned(key, lay, hq, q, scale, tables, plan, head_tables=True)
        try:
            return attn.run(q.contiguous(), *cache, window=window, logit_cap=logit_cap)
        except RuntimeError as exc:
            if key in self._on_triton or self.decode_kernel != DecodeKernel.CUDA:
                raise
            self._on_triton[key] = f"the CUDA kernel failed: {exc}"
            logger.warning("HACK decode: layers with %d query heads, K %d / V %d bits move to the Triton kernels: %s",
                           *key, exc)
            attn = self._decode[key] = self._planned(key, lay, hq, q, scale, (indptr, indices, lens), plan)
            if tables is not None:
                attn = self._planned(key, lay, hq, q, scale, tables, plan, head_tables=True)
            return attn.run(q.contiguous(), *cache, window=window, logit_cap=logit_cap)

    def _planned(self, key: tuple[int, int, int], lay: Any, hq: int, q: Tensor, scale: float,
                 tables: tuple[Tensor, Tensor, Tensor], plan: ForwardPlan, head_tables: bool = False) -> Any:
        """A decode kernel of this layer format planned on `tables` (kv_indptr, kv_indices,
        seq_lens): the forward's page table, or (head_tables) a sparse selection's, one list per
        KV head (PageSelection.head_csr)."""
        indptr, indices, lens = tables
        attn = self._decode_kernel(key, lay, hq, q, scale)
        attn.plan(indptr, indices, lens, tail_rows=self._csr[4], sink_slots=plan.sink_slot.to(self.device),
                  head_tables=head_tables)
        return attn

    def _decode_kernel(self, key: tuple[int, int, int], lay: Any, hq: int, q: Tensor, scale: float) -> Any:
        """The decode wrapper of one layer format: the CUDA kernel where it was chosen and reads
        the format, else Triton (each format's reason logged once)."""
        from hack_ops.triton.decode import HackDecodeAttention

        if self.decode_kernel == DecodeKernel.CUDA and key not in self._on_triton:
            why = layout_why_not(lay, hq)
            if why is None and q.dtype not in ACT_DTYPES:
                why = f"{q.dtype} activations (the kernel takes bf16 or fp16)"
            if why is None:
                from hack_ops.cuda.decode import CudaDecodeAttention

                return CudaDecodeAttention(lay, hq, sm_scale=scale)
            self._on_triton[key] = why
            logger.info("HACK decode: layers with %d query heads, K %d / V %d bits run on the Triton kernels: %s",
                        *key, why)
        return HackDecodeAttention(lay, hq, sm_scale=scale)

    def extend(self, layer: int, plan: ForwardPlan, q: Tensor, k: Tensor, v: Tensor,
               scale: float, window: int | None = None, logit_cap: float = 0.0) -> Tensor:
        from hack_ops.triton.prefill import HackPrefillAttention

        indptr, indices, lens, qo, rows = self._csr
        hq, lay = q.shape[1], self.store.layout_for(layer)
        key = (hq, lay.config.bits("k"), lay.config.bits("v"))
        attn = self._prefill.get(key)
        if attn is None:
            attn = HackPrefillAttention(lay, hq, sm_scale=scale)
            attn.plan(qo, indptr, indices, lens, tail_rows=rows, sink_slots=plan.sink_slot.to(self.device))
            self._prefill[key] = attn
        attn.sm_scale = float(scale)
        if self.prefill == PrefillMode.DENSE:
            return self._dense_extend(layer, plan, attn, q, k, v, scale, window, logit_cap)
        return attn.run(q.contiguous(), k.contiguous(), v.contiguous(), *self._cache(layer), window=window,
                        logit_cap=logit_cap)

    def prepare_store(self) -> None:
        """Build the CUDA store for this pool's head_dim and bf16 tokens (the usual activations)
        at startup, so the first prefill does not wait for nvcc (~10 s, once per machine: cached).
        A build that fails is logged here; its formats then take the Triton store at the first
        chunk (_store_chunk)."""
        from hack_ops.cuda.build import ActDtype, Variant, device_arch
        from hack_ops.cuda.store import load, store_why_not

        layouts = {id(lay): lay for lay in self.store.layouts}.values()
        if all(store_why_not(lay, torch.bfloat16) is not None for lay in layouts):
            return
        try:
            load(Variant(self.store.head_dim, ActDtype.BF16), device_arch(self.device))
        except Exception as exc:  # noqa: BLE001 - any failure leaves the Triton store, never the server down
            logger.warning("HACK prefill store: the CUDA store could not be built (%s); prefill stores with Triton",
                           str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    def _store_chunk(self, lay: Any, batch: Any, k: Tensor, v: Tensor, cache: tuple) -> None:
        """A prefill chunk's pages and tails. Where the CUDA kernels were chosen at startup and the
        CUDA store writes the layer's format (hack_ops.cuda.store: the closing pages and sinks,
        then the Triton store's tail phase), that; else the Triton store. A CUDA store that fails
        (a build, a launch: nothing written) moves its format to Triton with a warning."""
        from hack_ops.triton.store import store as triton_store

        fmt = (lay.config.bits("k"), lay.config.bits("v"), k.dtype)
        if self.decode_kernel == DecodeKernel.CUDA and fmt not in self._store_on_triton:
            from hack_ops.cuda.store import store as cuda_store
            from hack_ops.cuda.store import store_why_not

            why = store_why_not(lay, k.dtype)
            if why is None:
                try:
                    cuda_store(lay, batch, k, v, *cache)
                    return
                except RuntimeError as exc:
                    why = f"the CUDA store failed: {exc}"
                    logger.warning("HACK prefill store: K %d / V %d bits, %s tokens move to the Triton store: %s",
                                   *fmt, exc)
            else:
                logger.info("HACK prefill store: K %d / V %d bits, %s tokens on the Triton store: %s", *fmt, why)
            self._store_on_triton[fmt] = why
        triton_store(lay, batch, k, v, *cache, phase="all")

    def _dense_extend(self, layer: int, plan: ForwardPlan, attn: Any, q: Tensor, k: Tensor, v: Tensor,
                      scale: float, window: int | None, logit_cap: float) -> Tensor:
        """PrefillMode.DENSE: the chunk stored by the store kernel (attn's plan gives the batch),
        then dense attention. The prefix's open-page tokens are read before the store, which may
        close that page and reuse its tail."""
        from hack_ops.paged.attention import dense_attend, keep_open_tokens

        snaps = keep_open_tokens(self.store, layer, plan) if plan.has_prefix else {}
        self._store_chunk(self.store.layout_for(layer), attn.batch, k.contiguous(), v.contiguous(), self._cache(layer))
        dtype = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
        return dense_attend(self.store, layer, plan, q, k, v, snaps, scale, dtype, window, logit_cap)
