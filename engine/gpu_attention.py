"""GPU path of the `hack` backend: hack_ops.triton kernels behind the backend's plan/run calls.

Cannot run on this project's CI machine (no GPU); filled against hack_ops.triton's API.
"""
from __future__ import annotations

from typing import Any


class GpuAttention:
    def __init__(self, store: Any, settings: Any) -> None:
        raise NotImplementedError("the CUDA path of the 'hack' backend is not wired yet")
