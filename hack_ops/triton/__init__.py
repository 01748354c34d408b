"""Triton GPU kernels for paged HACK attention (see docs/kernels.md, "Triton (GPU)").

    store(layout, batch, k, v, k_buf, v_buf, tail_k, tail_v, sink_k, sink_v, phase="all")
    HackDecodeAttention(layout, num_qo_heads).plan(kv_indptr, kv_indices, seq_lens, ...).run(q, ...)
    HackPrefillAttention(layout, num_qo_heads).plan(qo_indptr, kv_indptr, ...).run(q, k, v, ...)
    plan_batch: a batch's CSR page table checked once (batch.batch_from_plan: from a ForwardPlan).

Importing this package needs triton; the kernels run on CUDA tensors, or on CPU tensors under
TRITON_INTERPRET=1 (the tests).
"""
from .batch import PagedBatch, plan_batch
from .decode import HackDecodeAttention
from .prefill import HackPrefillAttention
from .spec import KernelSpec, kernel_spec
from .store import store

__all__ = ["HackDecodeAttention", "HackPrefillAttention", "KernelSpec", "PagedBatch", "kernel_spec", "plan_batch",
           "store"]
