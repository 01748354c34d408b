"""engine.decode_choice: which GPU decode kernel a server runs and why, decided at startup; and
engine.gpu_attention's per-layer use of it (formats the CUDA kernel does not read go to Triton,
a CUDA kernel that fails at its first call hands the layer to Triton)."""
from __future__ import annotations

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
