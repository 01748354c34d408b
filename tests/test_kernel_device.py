"""Where the Triton kernel tests run (hack_ops/kernel_device.py, used by tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from hack_ops.kernel_device import KernelDevice, choose_kernel_device


def test_auto_follows_the_gpu():
    assert choose_kernel_device(None, True) is KernelDevice.CUDA
    assert choose_kernel_device("auto", False) is KernelDevice.INTERPRETER
    assert choose_kernel_device(" Interpreter ", True) is KernelDevice.INTERPRETER
    assert choose_kernel_device("cuda", True) is KernelDevice.CUDA
    assert choose_kernel_device(None, True, triton_interpret="1") is KernelDevice.INTERPRETER
    assert choose_kernel_device(None, True, triton_interpret="0") is KernelDevice.CUDA
    assert KernelDevice.CUDA.torch_device == torch.device("cuda")
    assert KernelDevice.INTERPRETER.torch_device == torch.device("cpu")


def test_impossible_choices_are_refused():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        choose_kernel_device("cuda", False)
    with pytest.raises(ValueError, match="contradicts TRITON_INTERPRET"):
        choose_kernel_device("cuda", True, triton_interpret="1")
    with pytest.raises(ValueError, match="must be one of"):
        choose_kernel_device("gpu", True)

