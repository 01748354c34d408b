"""`--hack-prefill auto`: which prefill a server runs when none is asked for, chosen at startup.

The CPU prefills trade places with the hardware (docs/engine.md, "Prefill: which mode on which
CPU"): on a CPU with AMX-BF16, torch's BF16 SDPA (oneDNN on AMX tiles) is several times faster
than the INT8 kernel's per-page work, so `dense` prefills faster (SmolLM2 at 2K: x0.84 of BF16
against x0.64); on AVX-512 VNNI without AMX the INT8 kernel is as fast as SDPA or faster (x1.34
against x0.93 on an AMD EPYC; about even on an Intel Xeon without AMX, where dense now attends in
float32). There `auto` is `int8`: the INT8 kernel reading a chunk's own tokens from 6-bit codes
(hack_ops.paged.chunk_codes) instead of the 2-bit pages the homomorphic prefill reads, which is
where that prefill lost its fidelity: within a few percent of the homomorphic prefill's speed, and
dense's outputs. So no choice trades accuracy for speed. Decode reads the 2-bit codes in every
mode. On a GPU, `auto` is dense too: on an H200 (docs/kernels.md,
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
                   has_int8_simd: bool | None = None, int8_refusal: str | None = None) -> tuple[PrefillMode, str]:
    """The prefill the server runs, and why. An explicit mode is kept as asked (a GPU server
    refuses exact at startup, engine.gpu_attention); 'auto' is resolved from the
    device, the model's dtype, the CPU's AMX-BF16 and whether the INT8 kernel has its SIMD path
    on this CPU. Where it picks the INT8 kernel, that is PrefillMode.INT8 (a chunk's own tokens
    read from 6-bit codes) for the default layout, homomorphic for the others (`int8_refusal`:
    hack_ops.paged.chunk_codes.layout_refusal of the server's format, None for the default). The
    strawman (`--hack-attention dequant`) prefills its own way, so its prefill is homomorphic by
    definition."""
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
    kernel = PrefillMode.INT8 if int8_refusal is None else PrefillMode.HOMOMORPHIC
    how = ("the INT8 kernel, a chunk's own tokens read from 6-bit codes (the homomorphic prefill's speed, "
           "dense's fidelity)" if kernel == PrefillMode.INT8 else
           f"the homomorphic INT8 kernel (not int8: {int8_refusal})")
    if not amx:
        return kernel, f"--hack-prefill auto: this CPU has no AMX-BF16, so {how}"
    if model_dtype != torch.bfloat16:
        return kernel, (f"--hack-prefill auto: the model runs in {str(model_dtype).removeprefix('torch.')}, "
                        f"which AMX-BF16 does not speed up, so {how}")
    return PrefillMode.DENSE, "--hack-prefill auto: this CPU has AMX-BF16 and the model runs in BF16"


def dense_dtype(device_type: str, model_dtype: torch.dtype, has_amx_bf16: bool | None = None) -> torch.dtype | None:
    """What a dense prefill (and the strawman's) attends in: float32 for a BF16 model on a CPU
    without AMX-BF16, where torch's BF16 SDPA runs at about half float32's rate (Intel Xeon
    without AMX, one layer's SmolLM2 2K prefill: BF16 86 ms, float32 53 ms; docs/engine.md), and
    float32 is the more exact; None (the model's BF16, through oneDNN's AMX tiles or the GPU's
    tensor cores) everywhere else."""
    if device_type != "cpu" or model_dtype != torch.bfloat16:
        return None
    amx = cpu_has_amx_bf16() if has_amx_bf16 is None else has_amx_bf16
    return None if amx else torch.float32
