"""Registers the `hack` attention backend with SGLang (name, factory, CLI choice)."""
from __future__ import annotations

from .settings import BACKEND_NAME

_done: list[bool] = []


def register_backend() -> None:
    if _done:
        return
    from sglang.srt.arg_groups.choices import add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    @register_attention_backend(BACKEND_NAME)
    def _create(runner):  # SGLang calls this with the ModelRunner
        from .backend import HackAttnBackend

        return HackAttnBackend(runner)

    add_attention_backend_choices([BACKEND_NAME])
    _done.append(True)
