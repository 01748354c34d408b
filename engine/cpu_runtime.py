"""Running SGLang without a GPU: the CPU engine switch and the `sgl_kernel` stand-in.

Both must be in place before SGLang imports its memory pool (module-level `is_cpu()` checks and
`from sgl_kernel import ...`), in this process and in every child it spawns. Children are
started with the spawn method, so they see os.environ (SGLANG_USE_CPU_ENGINE, PYTHONPATH) but
not this process's sys.modules.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path

from . import allocator

logger = logging.getLogger(__name__)

CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
STANDIN_DIR = Path(__file__).resolve().parent / "standin"


def gpu_available() -> bool:
    """True when a CUDA/ROCm device is usable (then SGLang's own platforms apply)."""
    import torch

    return bool(torch.cuda.is_available())


def cpu_engine_enabled() -> bool:
    return os.environ.get(CPU_ENGINE_ENV, "0") == "1"


def _real_sgl_kernel_importable() -> bool:
    if "sgl_kernel" in sys.modules:
        return not getattr(sys.modules["sgl_kernel"], "IS_HACK_STANDIN", False)
    try:
        mod = importlib.import_module("sgl_kernel")
    except Exception:  # ImportError, or OSError from a CUDA-only build's missing libraries
        sys.modules.pop("sgl_kernel", None)
        return False
    return not getattr(mod, "IS_HACK_STANDIN", False)


def install_sgl_kernel_standin() -> bool:
    """Put the stand-in on the import path of this process and its children, only when no
    real sgl_kernel imports. Returns True when the stand-in is (now) in use."""
    if _real_sgl_kernel_importable():
        return False
    path = str(STANDIN_DIR)
    if path not in sys.path:
        sys.path.insert(0, path)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if path not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([path, *parts])
    importlib.invalidate_caches()
    logger.info("sglang-hack: no real sgl_kernel could be imported; using the stand-in at %s", path)
    return True


def prepare() -> None:
    """Without a GPU: enable SGLang's CPU engine and make `sgl_kernel` importable. Idempotent.
    With a GPU nothing changes (unless the user set SGLANG_USE_CPU_ENGINE=1 on purpose)."""
    if not cpu_engine_enabled():
        if gpu_available():
            return
        os.environ[CPU_ENGINE_ENV] = "1"
    install_sgl_kernel_standin()


# libgomp's default spin-wait lets idle OpenMP workers of one server burn the cores another
# server needs. With a prefill and a decode server (plus a router) on 2 cores, a 2K-context
# decode step of SmolLM2 took ~1 s spinning and ~50 ms with passive waiting.
SHARED_HOST_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}

# Torch runs a BF16 linear through a oneDNN matmul built for its exact shape and keeps the built
# primitive in two caches, oneDNN's and ideep's, 1024 entries each by default; each entry costs
# ~1.3 MB of JIT code and buffers. A prefill server meets a new token count with almost every
# batch: in a 500-request soak it grew ~470 MB from the 100th request with the default caches
# and ~110 MB, flat from the 40% mark, with these (docs/reliability.md). 64 entries hold every
# shape of a decode step many times over (one per projection and batch size), so decode keeps
# hitting, and a prefill batch's new shape was a miss either way; a miss costs ~0.5 ms per
# projection.
PRIMITIVE_CACHE_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


def shared_host_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a server that shares this host's cores with other servers: OpenMP workers
    sleep instead of spinning, unless the caller chose a policy; oneDNN's per-shape caches are
    bounded; and the server's allocator is preloaded (engine/allocator.py). A value the caller
    set is kept. Returns `env` (updated)."""
    for key, value in {**SHARED_HOST_ENV, **PRIMITIVE_CACHE_ENV}.items():
        env.setdefault(key, value)
    allocator.apply(env)
    return env
