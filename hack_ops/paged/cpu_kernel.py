"""The compiled CPU decode kernel (placeholder until the extension lands): never usable."""
from __future__ import annotations


def why_not(store, mode, generator) -> str:
    return "the compiled CPU kernel is not built in this version"


def usable(store, mode, backend, generator) -> bool:
    return False


def decode(store, layer, plan, q, scale):  # pragma: no cover - never selected
    raise RuntimeError(why_not(store, "hack", None))
