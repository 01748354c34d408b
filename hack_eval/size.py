"""Bytes per token per layer of each KV format for a model's attention shape."""
from __future__ import annotations

import json

from hack_ops import HackConfig
from hack_ops.layout import bytes_per_token, page_layout

from .models import model_dir, prepare
from .variants import DEFAULT, PAPER


def model_shape(name: str) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) from the prepared model's config.json."""
    folder = model_dir(name)
    if not (folder / "config.json").is_file():
        folder = prepare(name)
    cfg = json.loads((folder / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], cfg.get("num_key_value_heads", cfg["num_attention_heads"]), head_dim


def size_table(name: str, context: int) -> list[dict]:
    if context < 1:
        raise ValueError(f"context must be positive, got {context}")
    _, heads, head_dim = model_shape(name)
    bf16 = 2 * 2 * heads * head_dim
    rows = [{"format": "bf16", "bytes_per_token_layer": float(bf16), "ratio": 1.0}]
    formats: list[tuple[str, HackConfig]] = [
        ("hack default " + DEFAULT.label(), DEFAULT),
        ("hack paper layout " + PAPER.label(), PAPER),
        ("hack 4-bit " + DEFAULT.replace(kv_bits=4).label(), DEFAULT.replace(kv_bits=4)),
        ("hack 4-bit K, 2-bit V " + DEFAULT.replace(k_bits=4).label(), DEFAULT.replace(k_bits=4)),
    ]
    formats += [(f"hack partition {p}", DEFAULT.replace(partition_size=p)) for p in (32, 128)]
    for label, cfg in formats:
        b = bytes_per_token(page_layout(cfg, heads, head_dim), context)
        rows.append({"format": label, "bytes_per_token_layer": b["bytes_per_token"], "ratio": b["ratio"]})
    layout = page_layout(DEFAULT, heads, head_dim)
    full = layout.page_bytes / layout.page_size
    rows.append({"format": "hack default, full pages only (no tails, no sinks)",
                 "bytes_per_token_layer": full, "ratio": full / bf16})
    return rows
