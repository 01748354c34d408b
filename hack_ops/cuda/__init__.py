"""The CUDA decode kernel: HACK pages read at the byte limit on Ampere and Hopper (sm80+); and the
prefill store that writes them (hack_ops.cuda.store).

    CudaDecodeAttention(layout, num_qo_heads).plan(kv_indptr, kv_indices, seq_lens, ...).run(q, ...)
    store.store(layout, batch, k, v, ...cache): a chunk's closing pages and sinks (CUDA), then its tails (Triton)
    layout_why_not / device_why_not: why a layer or a device takes the Triton path instead
    fragment: the bit-exact model of the kernel's MMA fragments and the fragment code order
    build: nvcc, cached per variant; profile: registers, spills and the page loop's SASS, no GPU

Design and measurements: docs/kernels.md, "CUDA decode kernel" and "CUDA store kernel (prefill)". Importing this package needs
torch and triton (the page-table and cache checks are hack_ops.triton's); building needs nvcc;
running needs a CUDA GPU.
"""
from .decode import CudaDecodeAttention
from .fragment import CodeOrder
from .spec import DecodeKernel, device_why_not, layout_why_not

__all__ = ["CodeOrder", "CudaDecodeAttention", "DecodeKernel", "device_why_not", "layout_why_not"]
