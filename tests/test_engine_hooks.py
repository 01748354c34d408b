"""The hook registry against the installed SGLang: every upstream symbol named in engine.hooks
exists, so a version bump that moves one fails here rather than silently in a server."""
from __future__ import annotations

import os
import pkgutil

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from engine import cpu_runtime  # noqa: E402

cpu_runtime.prepare()

from engine import hooks  # noqa: E402


@pytest.mark.parametrize("target", sorted({h.target for h in hooks.HOOKS} | set(hooks.DIRECT_USES)))
def test_upstream_symbol_exists(target):
    assert pkgutil.resolve_name(target) is not None


@pytest.mark.parametrize("cls,name", hooks.DIRECT_FIELDS)
def test_upstream_field_exists(cls, name):
    import dataclasses

    assert name in {f.name for f in dataclasses.fields(pkgutil.resolve_name(cls))}


def test_hooks_are_well_formed():
    from sglang.srt.plugins.hook_registry import HookType

    for h in hooks.HOOKS:
        assert h.kind in HookType.__members__, h
        assert callable(h.fn) and h.why, h


def test_plugin_entry_points_are_registered():
    from importlib.metadata import entry_points

    plugins = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    platforms = {ep.name: ep.value for ep in entry_points(group="sglang.srt.platforms")}
    assert plugins.get("hack") == "engine.plugin:load"
    assert platforms.get("hack") == "engine.platform:activate"


def test_layer_attributes_exist():
    """The RadixAttention attributes engine.backend / engine.model_checks read."""
    from sglang.srt.layers.radix_attention import RadixAttention

    layer = RadixAttention(num_heads=2, head_dim=64, scaling=0.125, num_kv_heads=1, layer_id=0)
    for name in hooks.LAYER_ATTRS:
        assert hasattr(layer, name), name
