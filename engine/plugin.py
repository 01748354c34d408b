"""The `sglang.srt.plugins` entry point, run by SGLang early in every process it starts."""
from __future__ import annotations


def load() -> None:
    from . import cpu_runtime, hooks

    cpu_runtime.prepare()
    hooks.register_all()
