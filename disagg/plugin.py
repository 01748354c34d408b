"""The `sglang.srt.plugins` entry point (`hack`), run by SGLang early in every process it starts.

SGLang calls load_plugins() in the launching process and again in each scheduler and
detokenizer process it spawns; each reads the installed entry points and calls this. It is the
one module that imports both layers: the PD connector adds its rows to the engine's hook table
(disagg -> engine), then the engine registers the whole table with SGLang. The platform entry
point (`engine.platform:activate`) needs no disaggregation and stays in the engine.
"""
from __future__ import annotations


def load() -> None:
    from engine import plugin as engine_plugin

    from . import connector

    connector.register()
    engine_plugin.load()
