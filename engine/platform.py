"""The `sglang.srt.platforms` entry point: SGLang's own platforms plus the HACK KV pool.

activate() picks SGLang's CPU platform on a machine without a GPU (enabling the CPU engine and
the sgl_kernel stand-in first) and its CUDA platform otherwise; in both cases the subclass
returns engine.pool.HackKVPool for MHA models when the server runs `--kv-cache-dtype hack`,
and SGLang's default pool otherwise. The CPU platform also defaults the model's dtype on a CPU
without BF16 arithmetic (engine.cpu_dtype), for every server, HACK or not. sglang.srt.mem_cache
is imported lazily: importing it while SGLang resolves its platform would be circular.
"""
from __future__ import annotations

from typing import Optional

from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.platforms.cuda import CudaSRTPlatform

from . import cpu_dtype, cpu_runtime
from . import settings as settings_mod


class _HackPoolMixin:
    def get_kv_pool_cls(self, *, kind: str) -> Optional[type]:
        if kind == "mha" and settings_mod.active() is not None:
            from .pool import HackKVPool

            return HackKVPool
        # MLA/DSA classes are resolved too (eagerly) but never built for MHA models; an MLA
        # model with --kv-cache-dtype hack is refused when the pool is sized (engine.capacity).
        return super().get_kv_pool_cls(kind=kind)


class HackCpuPlatform(_HackPoolMixin, CpuSRTPlatform):
    """SGLang's CPU platform with the HACK pool, and float32 weights where the CPU has no BF16
    arithmetic (engine.cpu_dtype)."""

    def apply_server_args_defaults(self, server_args) -> None:
        super().apply_server_args_defaults(server_args)
        cpu_dtype.apply_defaults(server_args)


class HackCudaPlatform(_HackPoolMixin, CudaSRTPlatform):
    """SGLang's CUDA platform with the HACK pool (attention through hack_ops.triton)."""


def activate() -> Optional[str]:
    cpu_runtime.prepare()
    if cpu_runtime.cpu_engine_enabled():
        return f"{__name__}:HackCpuPlatform"
    if cpu_runtime.gpu_available():
        import torch

        if torch.version.hip is None:
            return f"{__name__}:HackCudaPlatform"
    return None  # other hardware: leave SGLang's own platform selection alone
