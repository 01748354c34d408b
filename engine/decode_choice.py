"""Which decode attention a GPU server runs, chosen at startup with the reason logged.

The CUDA kernel (hack_ops.cuda: fp16 MMA on codes widened in registers, built with nvcc on the
machine) where the device and the toolchain allow it; else the Triton kernels (hack_ops.triton),
the portable path. Per layer, a format the CUDA kernel does not read (4-bit layers, Π other than
64, more than 8 query heads per KV head, ...) runs on Triton in either case
(engine.gpu_attention). The environment variable HACK_GPU_DECODE overrides: `triton` never
builds the CUDA kernel, `cuda` makes its absence an error at startup, `auto` (the default) is
the choice above. The dense prefill's store follows the same choice (engine.gpu_attention: the
CUDA store on the formats it writes where the CUDA kernels were chosen, else the Triton store).
"""
from __future__ import annotations

import os

import torch

from hack_ops.cuda.spec import DecodeKernel, device_why_not

ENV = "HACK_GPU_DECODE"
AUTO = "auto"


def requested_kernel(value: str | None) -> DecodeKernel | None:
    """HACK_GPU_DECODE's value as a DecodeKernel, None for auto (unset or 'auto')."""
    if value is None or value.strip() in ("", AUTO):
        return None
    try:
        return DecodeKernel(value.strip())
    except ValueError:
        raise ValueError(f"{ENV} must be one of {[AUTO, *(k.value for k in DecodeKernel)]}, got {value!r}") from None


def choose_decode_kernel(device: torch.device, requested: DecodeKernel | None = None,
                         build_check=None) -> tuple[DecodeKernel, str]:
    """The decode kernel a server on `device` runs, and why. build_check() -> reason or None tries
    the CUDA kernel's build (default: the head_dim-128 bf16 variant for this GPU), so a toolchain
    that cannot build it is found at startup, not at the first request."""
    if requested == DecodeKernel.TRITON:
        return DecodeKernel.TRITON, f"{ENV}=triton"
    why = device_why_not(device)
    if why is None:
        why = (build_check or _build_check)(device)
    if why is None:
        return DecodeKernel.CUDA, ("the CUDA kernel (fp16 MMA on the 2-bit codes) on layers it reads; the Triton "
                                   "kernels on the others")
    if requested == DecodeKernel.CUDA:
        raise RuntimeError(f"{ENV}=cuda, but the CUDA decode kernel cannot run here: {why}")
    return DecodeKernel.TRITON, f"the CUDA decode kernel cannot run here ({why}): the Triton kernels"


def _build_check(device: torch.device) -> str | None:
    from hack_ops.cuda.build import Variant, device_arch
    from hack_ops.cuda.launch import load

    try:
        load(Variant(), device_arch(device))
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


def decode_kernel_from_env() -> DecodeKernel | None:
    return requested_kernel(os.environ.get(ENV))
