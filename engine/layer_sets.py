"""Named layer sets for `--hack-4bit-layers` (and the CLI's `--4bit-layers`): a word that the
model's own config turns into 0-based layer indices, so a user need not know them.

`full`: the layers without a sliding window. In a model that mixes window and full-attention
layers (Gemma-2/3: one full layer in six), the full layers are the only ones that read keys
further back than the window, so the pass key and the in-context copy of a passage seen
earlier live there (docs/accuracy.md, "Retrieval"), and they are few, so their 4-bit pages
cost little. The word is resolved once, at startup (the server) or when a command starts (the
CLI), from the HF config; a model where it would name no layer or every layer is refused with
a sentence.

`auto`, the server's default: `full` where a model mixes both kinds and its full-attention
layers are at most a quarter of its layers (Gemma-2/3: one in six), nothing otherwise. On
Gemma-3-270M, 2-bit full-attention layers lose what only they can read: greedy recall of a
passage ~700 tokens back agreed with BF16 for 0.05 of its length, against 0.69 with those three
layers at 4 bits, and the pass key at 4K was found 27 times in 50 against BF16's and the 4-bit
layers' 41 (docs/accuracy.md), for 2.2 points of BF16's bytes. Where full layers are many
(alternating models) raising them would cost much more than that, and nothing measured here
says what it buys, so `auto` raises none there. `none`: no layer raised.
"""
from __future__ import annotations

import enum
import os
from typing import Any, Union

from .model_checks import architecture, text_config


class LayerSet(str, enum.Enum):
    FULL_ATTENTION = "full"
    AUTO = "auto"  # the server's default: FULL_ATTENTION where full layers are few, else none
    NONE = "none"


# `auto` raises a model's full-attention layers only where they are at most this share of its layers.
AUTO_MAX_SHARE = 0.25


LayerSpec = Union[tuple[int, ...], LayerSet]

# HF `layer_types` entries that attend over a bounded span of keys.
_WINDOWED = frozenset({"sliding_attention", "chunked_attention"})


def parse_layer_set(text: str) -> LayerSet | None:
    """The named set `text` names, or None when it is not a name (then it is a list of indices)."""
    try:
        return LayerSet(text.strip().lower())
    except ValueError:
        return None


def _num_layers(hf_config: Any) -> tuple[Any, int]:
    """The text config (a multimodal config's language part) and its layer count."""
    text = text_config(hf_config)
    return text, int(getattr(text, "num_hidden_layers", 0) or 0)


def full_attention_layers(hf_config: Any) -> tuple[int, ...]:
    """0-based indices of the layers with no sliding window, from an HF config (its text config
    for a multimodal one): `layer_types` where the config has it; otherwise every layer is windowed
    when the config sets `sliding_window` (Mistral-style; Qwen2's `use_sliding_window` honoured)
    and full when it does not."""
    text, n = _num_layers(hf_config)
    types = getattr(text, "layer_types", None)
    if types:
        return tuple(i for i, t in enumerate(types) if t not in _WINDOWED)
    windowed = bool(getattr(text, "sliding_window", None)) and getattr(text, "use_sliding_window", True) is not False
    return () if windowed else tuple(range(n))


def resolve_layers(spec: LayerSpec | None, hf_config: Any) -> tuple[int, ...] | None:
    """Indices for a spec: a tuple passes through; a named set is resolved from the config, and a
    set that names no layer or every layer is refused (ValueError) with what would work instead."""
    if spec is None or not isinstance(spec, LayerSet):
        return spec
    if spec is LayerSet.NONE:
        return ()
    arch = architecture(hf_config)
    layers, (_, n) = full_attention_layers(hf_config), _num_layers(hf_config)
    if spec is LayerSet.AUTO:
        return layers if 0 < len(layers) <= AUTO_MAX_SHARE * n else ()
    if not layers:
        raise ValueError(f"--hack-4bit-layers full names the layers without a sliding window, and every layer of "
                         f"model {arch} has one; name the layers as indices (e.g. those `hack eval layers` ranks "
                         "first) or use --hack-kv-bits 4")
    if len(layers) == n:
        raise ValueError(f"--hack-4bit-layers full names the layers without a sliding window, and model {arch} has no "
                         "sliding-window layers, so it would name all of them; use --hack-kv-bits 4 for every layer, "
                         "or name the layers as indices")
    return layers


def auto_reason(layers: tuple[int, ...]) -> str:
    """Why `auto` resolved to these layers, for the server log."""
    if layers:
        return ("the full-attention layers of a model with sliding-window layers, at 4 bits "
                "(docs/accuracy.md; --hack-4bit-layers none keeps every layer at --hack-kv-bits)")
    return "no layer: the model has no sliding-window layers, or full-attention layers are not few"


def resolve_for_model_path(spec: LayerSpec | None, model_path: str, trust_remote_code: bool = False) -> tuple[int, ...] | None:
    """resolve_layers with the HF config of a local model folder; a named set needs that config
    (`auto` without one raises no layer: a model SGLang fetches by name is checked later)."""
    if spec is None or not isinstance(spec, LayerSet):
        return spec
    if spec is LayerSet.NONE:
        return ()
    if spec is LayerSet.AUTO and not (model_path and os.path.isfile(os.path.join(model_path, "config.json"))):
        return ()
    if not model_path or not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ValueError(f"--hack-4bit-layers {spec.value} is resolved from the model's config.json, and "
                         f"{model_path!r} has none; name the layers as indices")
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError):
        if spec is LayerSet.AUTO:  # a default must not refuse a model; the model checks speak for it
            return ()
        raise
    return resolve_layers(spec, hf_config)
