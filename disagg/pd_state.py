"""What a HACK pool sends besides its pages, and the check that both sides agree on the format.

SGLang's transfer engine already moves the pool's page buffers (k_buffer/v_buffer, one item =
one page of codes + side tables; engine.pool.HackKVPool). Per request, two more things must
reach the decode server:
  - the FP16 tail of the open partition, per layer, in the request's row of store.tails;
  - the FP16 sink tokens, per layer, kept by the store in a slot keyed by the first page.
The tails ride SGLang's "live subrange of a per-request ring row" state component
(StateType.DSA_TAIL, built for DeepSeek's compressed-index tails): only the r = seq_len % Π
valid token slots of the request's row are sent, never the unused rest of the FP16 row. The
pool is described to that path with three attributes (kpool_use_compress, index_kpool = Π,
tail_extra_slots = 0) that SGLang's get_dsa_tail_state_indices reads. The sinks ride the
REQUEST_ROW component (one item per request row and tensor, sent row to row: all layers' K sinks
in one buffer, all V sinks in another). Sinks live in a slot, not a row, so each side keeps a
small per-row staging copy (`SinkStaging`): prefill copies the slot into the row just before the
last chunk is sent; decode copies the row into a freshly assigned slot once the transfer has
landed and before its first decode step.

The format check rides the bootstrap exchange: the kv-cache dtype string both sides register
(`kv_args.kv_cache_dtype_str`) becomes a fingerprint of the page layout, its version and the
model, and SGLang's own bootstrap comparison refuses a pairing whose strings differ
(disagg.connector.PdConnector.check_pairing turns that into one clear error per request).
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch

from hack_ops.layout import describe_layouts

logger = logging.getLogger(__name__)

FINGERPRINT_PREFIX = "hack"
# How the per-request state travels (bump when its buffers change: servers of different versions
# then refuse to pair, by the layout hash). 2: all layers' K sinks in one buffer, V's in another.
PD_STATE_VERSION = 2
STATIC_TAG = "+static-keep:"  # the fingerprint's suffix when static eviction's kept sets travel


@dataclass
class SinkStaging:
    """Per-request-row FP16 copies of the sink tokens, every layer's K in one buffer and every
    layer's V in another ([rows, layers, s, H, D] each), so that a request's sinks travel as two
    items, not one per layer and tensor: each item is a round trip of the transfer engine, and a
    lossy link stalls on round trips, not on bytes. Two, not one: SGLang's transfer of an MHA
    pool's state splits its buffers into a K half and a V half. `k[l]` / `v[l]` are views."""

    k_rows: torch.Tensor
    v_rows: torch.Tensor
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def for_store(cls, store: Any) -> "SinkStaging":
        s = store.config.sink_tokens
        shape = (store.num_rows, store.num_layers, max(s, 1), store.num_heads, store.head_dim)
        k_rows, v_rows = (torch.zeros(shape, dtype=torch.float16, device=store.device) for _ in range(2))
        return cls(k_rows=k_rows, v_rows=v_rows, k=list(k_rows.unbind(1)), v=list(v_rows.unbind(1)))


def is_hack_pool(pool: Any) -> bool:
    from engine.pool import HackKVPool

    return isinstance(pool, HackKVPool)


def model_path() -> str | None:
    """The served model's folder (None when SGLang's runtime context has none)."""
    try:
        from sglang.srt.runtime_context import get_model

        return str(get_model().model_path)
    except Exception:  # noqa: BLE001 - callers fall back to defaults
        return None


def model_identity() -> str:
    """A short name of the served model (the last component of its path)."""
    path = model_path()
    if path is None:  # the identity is informative; the geometry is checked too
        return "unknown"
    return path.rstrip("/").rsplit("/", 1)[-1]


def layout_fingerprint(pool: Any, model: str | None = None) -> str:
    """`hack:v<layout version>:P<partition>:<8 hex of the full layout>:<model>:L<layers>`.

    Readable parts first, so a mismatch message shows which one differs; the hash covers
    every field of the page layout (bits, orientation, sinks, tails, byte sizes)."""
    desc = {**describe_layouts(pool.store), "pd_state": PD_STATE_VERSION}
    digest = hashlib.blake2b(json.dumps(desc, sort_keys=True).encode(), digest_size=4).hexdigest()
    model = model if model is not None else model_identity()
    kept = getattr(pool, "disagg_kept_staging", None)
    # static eviction: the kept set's staging row must be the same on both sides, and a decode
    # server without it would read the pages prefill left off the wire
    static = "" if kept is None else f"{STATIC_TAG}{kept.bits.shape[2]}x{kept.max_pages}"
    return (f"{FINGERPRINT_PREFIX}:v{desc['version']}:P{desc['partition_size']}:{digest}:"
            f"{model}:L{pool.layer_num}{static}")


def describe_fingerprint(fp: str) -> str:
    fp, _, static = fp.partition(STATIC_TAG)
    kept = (f"; static eviction on (kept sets of {static.split('x')[0]} row(s) per layer, up to "
            f"{static.split('x')[-1]} pages)" if static else "")
    parts = fp.split(":")
    if len(parts) != 6 or parts[0] != FINGERPRINT_PREFIX:
        return f"kv_cache_dtype={fp}"
    _, ver, part, digest, model, layers = parts
    return (f"layout version {ver[1:]}, partition size {part[1:]}, layout hash {digest}, "
            f"model {model} ({layers[1:]} layers){kept}")


def _infos(tensors: list[torch.Tensor]) -> tuple[list[int], list[int], list[int]]:
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("HACK per-row buffers must be contiguous to be transferred")
    return ([t.data_ptr() for t in tensors], [t.nbytes for t in tensors],
            [t[0].nbytes for t in tensors])


def buffer_layers(pool: Any) -> dict[int, int]:
    """The layer each of the pool's K and V page buffers holds, by the buffer's address (what
    the transfer engine names a buffer by)."""
    out = {int(t.data_ptr()): layer for layer, t in enumerate(pool.k_buffer)}
    out.update({int(t.data_ptr()): layer for layer, t in enumerate(pool.v_buffer)})
    return out


def tail_buffers(pool: Any) -> list[torch.Tensor]:
    """The FP16 tail rows [rows, Π, H, D] of each tail tensor ('k', 'v') and layer, in order."""
    store = pool.store
    return [t for name in sorted(store.tails) for t in store.tails[name]]


def sink_buffers(pool: Any) -> list[torch.Tensor]:
    if not pool.store.config.sink_tokens:
        return []
    staging = pool.disagg_sink_staging
    return [staging.k_rows, staging.v_rows]


@dataclass(frozen=True)
class HackStateIndices:
    """What the digest of one request's per-row state covers: the first `live` token slots of
    row `row` in the `num_tail` tail buffers (slot = item_len / Π bytes), then the whole row of
    every sink staging buffer."""

    row: int
    live: int
    num_tail: int
    page_size: int


def state_indices(pool: Any, row: int, seq_len: int) -> HackStateIndices:
    return HackStateIndices(int(row), int(seq_len) % pool.page_size, len(tail_buffers(pool)),
                            pool.page_size)


def attach(kv_args: Any, pool: Any, max_pages: int | None = None) -> None:
    """Describe the HACK pool's per-request state to SGLang's transfer engine and put the
    format fingerprint where the bootstrap exchange compares it. Same order on both sides.
    max_pages: the most pages a request can hold (its req_to_token row), which sizes the kept
    set's staging row under static eviction (disagg.static_wire)."""
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import append_state_component

    if not hasattr(pool, "disagg_sink_staging"):
        pool.disagg_sink_staging = SinkStaging.for_store(pool.store)
    # Read by sglang.srt.disaggregation.utils.get_dsa_tail_state_indices on both sides.
    pool.kpool_use_compress = True
    pool.index_kpool = pool.page_size
    pool.tail_extra_slots = 0
    tails = tail_buffers(pool)
    if tails:
        append_state_component(kv_args, StateType.DSA_TAIL, *_infos(tails))
    sinks = sink_buffers(pool)
    if sinks:
        append_state_component(kv_args, StateType.REQUEST_ROW, *_infos(sinks))
    kept = kept_staging(pool, max_pages)
    if kept is not None:
        from .static_wire import activate

        append_state_component(kv_args, StateType.REQUEST_ROW, *_infos(kept.buffers()))
        activate(kept, buffer_layers(pool))
    kv_args.kv_cache_dtype_str = layout_fingerprint(pool)
    logger.info("sglang-hack PD: pages + %d tail and %d sink buffers per request; format %s",
                len(tails), len(sinks), kv_args.kv_cache_dtype_str)


def kept_staging(pool: Any, max_pages: int | None = None):
    """The pool's staging rows of static eviction's kept sets (disagg.static_wire), made on
    first use when --hack-static-keep is on; None when it is off."""
    from .static_wire import KeptStaging

    got = getattr(pool, "disagg_kept_staging", None)
    settings = getattr(pool, "hack_settings", None)
    if got is not None or settings is None or not settings.static.enabled:
        return got
    if max_pages is None:
        raise RuntimeError("static eviction over PD sizes its per-request rows from the request table: "
                           "SGLang did not pass it")
    pool.disagg_kept_staging = KeptStaging.for_store(pool.store, settings.static.unit, max_pages)
    return pool.disagg_kept_staging


def _first_page(req_to_token: torch.Tensor, row: int, page_size: int) -> int:
    return int(req_to_token[row, 0]) // page_size


def stage_sinks_for_send(pool: Any, req_to_token: torch.Tensor, row: int) -> bool:
    """Prefill: copy the request's sink slot into its staging row. False if it has none."""
    store = pool.store
    if not store.config.sink_tokens:
        return False
    slot = int(store.sink_map[_first_page(req_to_token, row, store.page_size)])
    if slot < 0:
        return False
    staging = pool.disagg_sink_staging
    for layer in range(store.num_layers):
        staging.k[layer][row].copy_(store.sink_k[layer][slot])
        staging.v[layer][row].copy_(store.sink_v[layer][slot])
    return True


def install_received_sinks(pool: Any, req_to_token: torch.Tensor, row: int) -> int:
    """Decode: give the received sequence's first page a sink slot and fill it from the
    staging row. Returns the slot (-1 when the format keeps no sinks)."""
    store = pool.store
    if not store.config.sink_tokens:
        return -1
    first = torch.tensor([_first_page(req_to_token, row, store.page_size)], dtype=torch.long)
    slot = int(store.sink_slots_for(first, allocate=True)[0])
    staging = pool.disagg_sink_staging
    for layer in range(store.num_layers):
        store.sink_k[layer][slot].copy_(staging.k[layer][row])
        store.sink_v[layer][slot].copy_(staging.v[layer][row])
    return slot
