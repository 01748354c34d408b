"""`--hack-prefill auto`: which prefill a server runs when none is asked for, chosen at startup.

The two CPU prefills trade places with the hardware (docs/engine.md, "Prefill: which mode on
which CPU"): on a CPU with AMX-BF16, torch's BF16 SDPA (oneDNN on AMX tiles) is several times
faster than the homomorphic INT8 kernel's per-page work, so `dense` prefills faster (SmolLM2 at
2K: x0.84 of BF16 against x0.64); on AVX-512 without AMX the BF16 SDPA costs what float32 does
and `homomorphic` is the faster (x1.34 against x0.93). Dense is also the more accurate of the
two (a chunk's own tokens in FP16), so choosing it never trades accuracy for speed. Decode
reads the codes in either. On a GPU, `auto` is dense too: on an H200 (docs/kernels.md,
"Measured on a GPU") the homomorphic Triton prefill of a fresh prompt took 14-20x BF16 flash
attention's time, while storing the prompt with the Triton store kernel and attending densely
took 1.2-4.7x (the store is most of that at 2K); the dense GPU prefill itself has not run on a GPU yet
(its pieces have: the store kernel and SDPA, in that benchmark).

On a CPU without AVX-512 VNNI (AVX2 only) the INT8 kernel runs its AVX2 build (vpmaddubsw; plain C
loops before it, when SmolLM2's 2K server prefill ran at 24 tok/s homomorphic against 232 dense):
one layer's homomorphic prefill, store included, took x0.64-0.99 of SDPA's speed (SmolLM2 and
Gemma-3 at 2K and 8K, AMD EPYC Zen 3, docs/engine.md), and a SmolLM2 server prefilled 2K tokens at
261-275 tok/s homomorphic against 255-282 dense, so `auto` is dense there, whatever the dtype: no
slower, and the more accurate.

The choice reads torch's own view of the CPU (torch.cpu.get_capabilities, what its kernels
dispatch on), falling back to /proc/cpuinfo's flags, and asks the INT8 kernel's build whether
it has its SIMD path.
"""
from __future__ import annotations

from pathlib import Path

import torch

from hack_ops.modes import AttentionMode, PrefillMode, prefill_mode

from . import cpu_dtype


def cpu_has_amx_bf16(capabilities: dict | None = None, cpuinfo: str | None = None) -> bool:
    """Whether this CPU (or the given torch capabilities / /proc/cpuinfo text) has AMX-BF16."""
    if capabilities is None and cpuinfo is None:
        # torch's view; when it cannot say ({}), the kernel's flags below
        capabilities = cpu_dtype.cpu_capabilities() or None
    if capabilities is not None:
        return bool(capabilities.get("amx_bf16", False))
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return any(line.startswith("flags") and "amx_bf16" in line.split() for line in cpuinfo.splitlines())


def int8_kernel_simd() -> bool:
    """Whether the homomorphic prefill's INT8 kernel was built with its AVX-512 VNNI path here
    (its AVX2 build does not outrun dense attention)."""
    from hack_ops.paged import cpu_extend

    return cpu_extend.simd()


def choose_prefill(requested: PrefillMode | str, attention: AttentionMode, device_type: str,
                   model_dtype: torch.dtype, has_amx_bf16: bool | None = None,
                   has_int8_simd: bool | None = None) -> tuple[PrefillMode, str]:
    """The prefill the server runs, and why. An explicit mode is kept as asked (a GPU server
    refuses exact at startup, engine.gpu_attention); 'auto' is resolved from the
    device, the model's dtype, the CPU's AMX-BF16 and whether the INT8 kernel has its SIMD path
    on this CPU. The strawman (`--hack-attention dequant`) prefills its own way, so its prefill
    is homomorphic by definition."""
    requested = prefill_mode(requested)
    if attention != AttentionMode.HACK:
        return PrefillMode.HOMOMORPHIC, f"--hack-attention {attention.value} prefills as the strawman"
    if requested != PrefillMode.AUTO:
        return requested, f"--hack-prefill {requested.value}"
    if device_type != "cpu":
        return PrefillMode.DENSE, (f"--hack-prefill auto on {device_type}: the Triton store, then dense attention "
                                   "(the homomorphic Triton prefill measured 3-17x slower, docs/kernels.md)")
    simd = int8_kernel_simd() if has_int8_simd is None else has_int8_simd
    if not simd:
        return PrefillMode.DENSE, ("--hack-prefill auto: the INT8 kernel has no AVX-512 VNNI path on this CPU "
                                   "(its AVX2 or plain-C build prefills no faster than dense here, and dense "
                                   "is the more accurate)")
    amx = cpu_has_amx_bf16() if has_amx_bf16 is None else has_amx_bf16
    if not amx:
        return PrefillMode.HOMOMORPHIC, ("--hack-prefill auto: this CPU has no AMX-BF16, so the INT8 kernel "
                                         "outruns BF16 SDPA")
    if model_dtype != torch.bfloat16:
        return PrefillMode.HOMOMORPHIC, (f"--hack-prefill auto: the model runs in {str(model_dtype).removeprefix('torch.')}, "
                                         "which AMX-BF16 does not speed up")
    return PrefillMode.DENSE, "--hack-prefill auto: this CPU has AMX-BF16 and the model runs in BF16"
