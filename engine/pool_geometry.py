"""Byte sizes of everything the HACK pool allocates, for sizing and capacity reports.

The sizes are read from hack_ops.paged.HackKVStore itself (a one-page, one-row, one-sink-slot
store of the model's layers), so they follow its buffers whatever the format (layers with more
bits, --hack-4bit-layers, hold larger pages): K and V pages, the FP16
tails of each request row, FP16 sink slots (one per row plus one per SINK_PAGES_PER_SLOT pages,
the store's default) and the shared page -> sink-slot map; and what the same tokens take in a
BF16 cache, the baseline every capacity and usage report compares against.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from hack_ops import HackConfig
from hack_ops.paged.store import HackKVStore

SINK_PAGES_PER_SLOT = 16  # HackKVStore's default: num_sink_slots = rows + pages // 16
_SINK_MAP_ENTRY = 4  # int32 per page
BF16_BYTES = 2


def bf16_bytes_per_token(layers: int, kv_heads: int, head_dim: int) -> int:
    """Bytes one token's K and V take in a BF16 cache of this geometry (all layers)."""
    return 2 * int(layers) * int(kv_heads) * int(head_dim) * BF16_BYTES


@dataclass(frozen=True)
class UnitBytes:
    """Bytes of one layer: per page (codes + side tables, averaged over the model's layers, which
    may differ in bits), per request row (tails), per sink slot."""

    page: float
    row: int
    sink_slot: int
    page_size: int


@lru_cache(maxsize=32)
def unit_bytes(config: HackConfig, num_heads: int, head_dim: int, num_layers: int | None = None) -> UnitBytes:
    """The units of a model of `num_layers` layers (a config whose layers differ needs the real
    count: HackConfig.for_layer resolves which layers get more bits; None: a uniform config)."""
    if num_layers is None:
        if config.per_layer:
            raise ValueError(f"{config.label()} differs per layer: give the model's num_layers")
        num_layers = 1
    probe = HackKVStore(config, num_layers, num_heads, head_dim, num_pages=1, num_rows=1,
                        num_sink_slots=1 if config.sink_tokens else 0)
    nb = probe.nbytes()
    return UnitBytes(page=nb["pages"] / num_layers, row=nb["tails"] // num_layers,
                     sink_slot=nb["sinks"] // num_layers, page_size=config.partition_size)


def row_bytes(u: UnitBytes, num_layers: int) -> int:
    """What each request row costs, all layers: its tails and its sink slot."""
    return num_layers * (u.row + u.sink_slot)


def page_bytes_all_layers(u: UnitBytes, num_layers: int) -> float:
    """What each page costs, all layers: codes + side tables, its share of the sink slots of
    cached sequences, and its sink-map entry."""
    return num_layers * (u.page + u.sink_slot / SINK_PAGES_PER_SLOT) + _SINK_MAP_ENTRY


def token_bytes(u: UnitBytes, num_layers: int) -> int:
    """Bytes per cached token (rounded up): what SGLang divides its budget by."""
    return int(-(-page_bytes_all_layers(u, num_layers) // u.page_size))


def num_sink_slots(config: HackConfig, num_rows: int, num_pages: int) -> int:
    return num_rows + num_pages // SINK_PAGES_PER_SLOT if config.sink_tokens else 0
