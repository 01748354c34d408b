"""Where the Triton kernels run: on a CUDA GPU, or in Triton's CPU interpreter on CPU tensors.

The choice has to be made before triton is first imported (Triton fixes interpreted or
compiled mode when it decorates a function), so this module imports neither triton nor
hack_ops.triton. tests/conftest.py calls `choose_kernel_device` with the environment:

    HACK_KERNEL_DEVICE=auto         (default) CUDA when torch sees a GPU, else the interpreter
    HACK_KERNEL_DEVICE=cuda         CUDA, or a clear error when there is no GPU
    HACK_KERNEL_DEVICE=interpreter  the interpreter even on a GPU machine
"""
from __future__ import annotations

from enum import Enum

import torch

ENV = "HACK_KERNEL_DEVICE"
AUTO = "auto"


class KernelDevice(str, Enum):
    CUDA = "cuda"
    INTERPRETER = "interpreter"

    @property
    def torch_device(self) -> torch.device:
        """The device of the tensors the kernels take: CUDA, or CPU under the interpreter."""
        return torch.device("cuda") if self is KernelDevice.CUDA else torch.device("cpu")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "on", "yes")


def choose_kernel_device(setting: str | None, cuda_available: bool, triton_interpret: str | None = None) -> KernelDevice:
    """The kernel device for HACK_KERNEL_DEVICE=`setting`, given whether torch sees a GPU and
    the TRITON_INTERPRET variable (set by hand, it forces the interpreter)."""
    choice = (setting or AUTO).strip().lower()
    allowed = (AUTO, *(d.value for d in KernelDevice))
    if choice not in allowed:
        raise ValueError(f"{ENV} must be one of {', '.join(allowed)}, got {setting!r}")
    if _truthy(triton_interpret):
        if choice == KernelDevice.CUDA.value:
            raise ValueError(f"{ENV}=cuda contradicts TRITON_INTERPRET={triton_interpret} (the interpreter); "
                             "unset one of them")
        return KernelDevice.INTERPRETER
    if choice == KernelDevice.CUDA.value and not cuda_available:
        raise ValueError(f"{ENV}=cuda but torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    if choice == AUTO:
        return KernelDevice.CUDA if cuda_available else KernelDevice.INTERPRETER
    return KernelDevice(choice)
