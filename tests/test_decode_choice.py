"""engine.decode_choice: which GPU decode kernel a server runs and why, decided at startup; and
engine.gpu_attention's per-layer use of it (formats the CUDA kernel does not read go to Triton,
a CUDA kernel that fails at its first call hands the layer to Triton)."""
from __future__ import annotations

import importlib
import logging

import pytest
import torch

from engine.decode_choice import ENV, choose_decode_kernel, requested_kernel
from hack_ops.cuda.spec import DecodeKernel


def test_env_values():
    assert requested_kernel(None) is None and requested_kernel("auto") is None and requested_kernel(" ") is None
    assert requested_kernel("cuda") == DecodeKernel.CUDA and requested_kernel("triton") == DecodeKernel.TRITON
    with pytest.raises(ValueError, match=ENV):
        requested_kernel("flash")


def test_choice_and_reasons(monkeypatch):
    from engine import decode_choice

    cuda = torch.device("cuda")
    kernel, why = choose_decode_kernel(cuda, DecodeKernel.TRITON)
    assert kernel == DecodeKernel.TRITON and why == f"{ENV}=triton"
    monkeypatch.setattr(decode_choice, "device_why_not", lambda device: "no CUDA device")
    kernel, why = choose_decode_kernel(cuda)
    assert kernel == DecodeKernel.TRITON and "no CUDA device" in why
    with pytest.raises(RuntimeError, match="cannot run here: no CUDA device"):
        choose_decode_kernel(cuda, DecodeKernel.CUDA)
    monkeypatch.setattr(decode_choice, "device_why_not", lambda device: None)
    kernel, why = choose_decode_kernel(cuda, build_check=lambda device: "building the CUDA decode kernel failed")
    assert kernel == DecodeKernel.TRITON and "building" in why
    kernel, why = choose_decode_kernel(cuda, build_check=lambda device: None)
    assert kernel == DecodeKernel.CUDA and "Triton kernels on the others" in why


def test_gpu_attention_sends_each_layer_format_to_a_kernel(monkeypatch, caplog):
    """With the CUDA kernel chosen, a 2-bit Π=64 layer with bf16 queries gets it, a 4-bit layer
    and float32 queries get Triton, each reason logged once."""
    from engine import gpu_attention
    from engine.settings import EngineSettings
    from hack_ops import HackConfig, PrefillMode
    from hack_ops.cuda.decode import CudaDecodeAttention
    from hack_ops.paged import HackKVStore
    from hack_ops.triton.decode import HackDecodeAttention

    monkeypatch.setattr(gpu_attention, "choose_decode_kernel", lambda device, requested: (DecodeKernel.CUDA, "test"))
    store = HackKVStore(HackConfig(four_bit_layers=(1,)), 2, 2, 128, num_pages=4, num_rows=2)
    with caplog.at_level(logging.INFO, logger="engine.gpu_attention"):
        gpu = gpu_attention.GpuAttention(store, EngineSettings(), PrefillMode.DENSE)
        q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
        two, four = store.layout_for(0), store.layout_for(1)
        assert isinstance(gpu._decode_kernel((8, 2, 2), two, 8, q, 0.1), CudaDecodeAttention)
        assert isinstance(gpu._decode_kernel((8, 4, 4), four, 8, q, 0.1), HackDecodeAttention)
        assert isinstance(gpu._decode_kernel((8, 4, 4), four, 8, q, 0.1), HackDecodeAttention)
        assert isinstance(gpu._decode_kernel((9, 2, 2), two, 8, q.float(), 0.1), HackDecodeAttention)
    assert "HACK decode attention kernel: cuda [test]" in caplog.text
    assert caplog.text.count("4-bit K / 4-bit V") == 1
    assert "float32 activations" in caplog.text


def test_gpu_prefill_store_takes_the_cuda_store_where_it_writes(monkeypatch, caplog):
    """With the CUDA kernels chosen, a dense prefill chunk of a layer the CUDA store writes (2- or
    4-bit, Π = 64, bf16 tokens) goes to it; float32 tokens go to the Triton store with the reason
    logged once; a CUDA store that fails moves its format to Triton with a warning, for good."""
    from engine import gpu_attention
    from engine.settings import EngineSettings
    from hack_ops import HackConfig, PrefillMode
    from hack_ops.paged import HackKVStore

    cuda_store = importlib.import_module("hack_ops.cuda.store")
    triton_store = importlib.import_module("hack_ops.triton.store")  # the module: the package exports store()

    calls = []
    monkeypatch.setattr(gpu_attention, "choose_decode_kernel", lambda device, requested: (DecodeKernel.CUDA, "test"))
    monkeypatch.setattr(cuda_store, "store", lambda lay, *a: calls.append(("cuda", lay.config.bits("k"))))
    monkeypatch.setattr(triton_store, "store", lambda lay, *a, phase: calls.append(("triton", lay.config.bits("k"))))
    store = HackKVStore(HackConfig(four_bit_layers=(1,)), 2, 2, 128, num_pages=4, num_rows=2)
    k = torch.zeros(3, 2, 128, dtype=torch.bfloat16)
    two, four = store.layout_for(0), store.layout_for(1)
    with caplog.at_level(logging.INFO, logger="engine.gpu_attention"):
        gpu = gpu_attention.GpuAttention(store, EngineSettings(), PrefillMode.DENSE)
        for lay, x in ((two, k), (four, k), (two, k.float()), (two, k.float())):
            gpu._store_chunk(lay, None, x, x, ())
        assert calls == [("cuda", 2), ("cuda", 4), ("triton", 2), ("triton", 2)]
        assert caplog.text.count("on the Triton store: torch.float32 tokens") == 1

        def fails(*a):
            raise RuntimeError("the CUDA store kernel failed to launch: too many resources requested")

        monkeypatch.setattr(cuda_store, "store", fails)
        calls.clear()
        gpu._store_chunk(four, None, k, k, ())
        monkeypatch.setattr(cuda_store, "store", lambda lay, *a: calls.append(("cuda", 4)))
        gpu._store_chunk(four, None, k, k, ())
    assert calls == [("triton", 4), ("triton", 4)]
    assert "move to the Triton store: the CUDA store kernel failed to launch" in caplog.text


def test_gpu_prefill_store_stays_on_triton_when_triton_decode_was_chosen(monkeypatch):
    from engine import gpu_attention
    from engine.settings import EngineSettings
    from hack_ops import HackConfig, PrefillMode
    from hack_ops.paged import HackKVStore

    cuda_store = importlib.import_module("hack_ops.cuda.store")
    triton_store = importlib.import_module("hack_ops.triton.store")  # the module: the package exports store()

    calls = []
    monkeypatch.setattr(gpu_attention, "choose_decode_kernel",
                        lambda device, requested: (DecodeKernel.TRITON, "HACK_GPU_DECODE=triton"))
    monkeypatch.setattr(cuda_store, "store", lambda lay, *a: calls.append("cuda"))
    monkeypatch.setattr(triton_store, "store", lambda lay, *a, phase: calls.append("triton"))
    store = HackKVStore(HackConfig(), 2, 2, 128, num_pages=4, num_rows=2)
    gpu = gpu_attention.GpuAttention(store, EngineSettings(), PrefillMode.DENSE)
    k = torch.zeros(3, 2, 128, dtype=torch.bfloat16)
    gpu._store_chunk(store.layout_for(0), None, k, k, ())
    assert calls == ["triton"]


def test_the_cuda_store_is_built_at_startup_and_a_failed_build_is_only_logged(monkeypatch, caplog):
    """GpuAttention.prepare_store builds the store for the pool's head_dim before the first
    prefill; a build that fails is a warning, not a failed server (the formats take Triton)."""
    from engine import gpu_attention
    from engine.settings import EngineSettings
    from hack_ops import HackConfig, PrefillMode
    from hack_ops.cuda import build
    from hack_ops.paged import HackKVStore

    cuda_store = importlib.import_module("hack_ops.cuda.store")
    built = []
    monkeypatch.setattr(gpu_attention, "choose_decode_kernel", lambda device, requested: (DecodeKernel.CUDA, "test"))
    monkeypatch.setattr(build, "device_arch", lambda device=None: 90)
    monkeypatch.setattr(cuda_store, "load", lambda variant, arch: built.append((variant.head_dim, arch)))
    store = HackKVStore(HackConfig(), 2, 2, 64, num_pages=4, num_rows=2)
    gpu = gpu_attention.GpuAttention(store, EngineSettings(), PrefillMode.DENSE)
    assert built == []  # a CPU device: nothing to build
    gpu.prepare_store()
    assert built == [(64, 90)]

    def fails(variant, arch):
        raise RuntimeError("the CUDA store kernel (d64-bf16@sm90) is unavailable: nvcc not found")

    monkeypatch.setattr(cuda_store, "load", fails)
    with caplog.at_level(logging.WARNING, logger="engine.gpu_attention"):
        gpu.prepare_store()
    assert "the CUDA store could not be built (the CUDA store kernel (d64-bf16@sm90) is unavailable" in caplog.text
    built.clear()
    monkeypatch.setattr(cuda_store, "load", lambda variant, arch: built.append(variant.head_dim))
    gpu.store = HackKVStore(HackConfig(partition_size=32), 2, 2, 64, num_pages=4, num_rows=2)
    gpu.prepare_store()  # Π = 32: no layer the CUDA store writes, nothing built
    assert built == []
