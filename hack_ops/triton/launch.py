"""A kernel launch as data: the wrappers build it, run it, and the AOT compiler reads it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Launch:
    kernel: Any  # a triton.JITFunction
    grid: tuple[int, ...]
    args: list  # positional runtime arguments, in the kernel's order
    constexprs: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)  # num_warps, num_stages, enable_fp_fusion

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options)
