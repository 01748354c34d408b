"""The engine's part of plugin loading: the CPU runtime, then every row of the hook table.

SGLang reaches it through the `sglang.srt.plugins` entry point (disagg.plugin:load), which
first lets the packages above the engine add their rows (engine.hooks.register_extension).
"""
from __future__ import annotations


def load() -> None:
    from . import cpu_runtime, hooks

    cpu_runtime.prepare()
    hooks.register_all()
