"""The metrics record schema (version 3): one Arrow schema for events and samples.

Every row is one record. `kind` says what it is:

- point events: ``arrival``, ``first_token``, ``finish``, ``error``
- phase boundaries: ``start`` / ``end`` with ``phase`` set (the span is start..end)
- ``span``: a phase whose duration is known when it ends (``t_ns`` is its end,
  ``dur_ns`` its length); used for phases fused into a kernel, whose time is measured
  or attributed inside that kernel, and for decode summaries
- ``step``: one decode step of one request (``dur_ns``, ``tokens``)
- ``sample``: a periodic sample of one server (pool, bytes, requests, RSS)

Times are wall-clock UNIX nanoseconds (``time.time_ns()``), so that streams written by
different processes on one machine can be joined; across machines the clocks must be
synchronized (NTP) for the joined timeline to be exact.

The version lives in the Arrow schema metadata (key ``hack.schema_version``) and in the
``schema_version`` column of every row. Readers refuse versions they do not know.
"""
from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 3
SUPPORTED_VERSIONS = frozenset({1, 2, 3})
VERSION_KEY = b"hack.schema_version"

POINT_KINDS = ("arrival", "first_token", "finish", "error")
BOUNDARY_KINDS = ("start", "end")
KINDS = POINT_KINDS + BOUNDARY_KINDS + ("span", "step", "sample")

# Phases of a request. The paper's breakdown (Fig. 10) uses prefill, quantization,
# transfer (KV communication), approximation (HACK) / dequantization (baselines) and
# decode; queue is the wait before prefill (or before decode admission).
PHASES = ("queue", "prefill", "quantization", "transfer", "approximation",
          "dequantization", "decode")

# When phases overlap in time (quantization and approximation run inside prefill/decode
# kernels; a layer-wise transfer overlaps prefill), the exclusive breakdown gives each
# instant to the first active phase in this order, so no time is counted twice.
EXCLUSIVE_PRIORITY = ("quantization", "approximation", "dequantization", "prefill",
                      "decode", "transfer", "queue")

ROLES = ("prefill", "decode", "colocated", "router")

# How a duration was obtained (the `method` column):
#   timer      - wall clock read at the phase boundaries on the host
#   attributed - part of a fused kernel's time assigned to this phase (see docs)
#   derived    - computed from other records (e.g. a decode summary from its steps)
METHODS = ("timer", "attributed", "derived")

SAMPLE_FIELDS = ("pages_used", "pages_total", "bytes_codes", "bytes_side", "bytes_tail",
                 "bytes_bf16", "running", "queued", "rss_bytes", "pages_selected", "pages_visible",
                 "tier_bytes", "tier_hit_pages", "tier_asked_pages")
# Columns each version added. Version 2: sparse decode's pages per decode step and sparse
# layer over the sample's interval, summed over the batch: `pages_selected` (the closed pages
# the selection read) and `pages_visible` (the closed pages a dense step reads there); null
# without sparse decode or without a decode step in the interval. Static eviction
# (--hack-static-keep) fills the same two: the kept pages read, against resident.
# Version 3: the page tier (--hack-page-tier). On samples, the tier's bytes on disk and, since
# the server started, the uncached pages new requests asked it for and the pages it found
# (`tier_hit_pages / tier_asked_pages` is its hit rate); null without a tier. On a request's
# prefill `end` record, the prompt tokens it did not compute (`cached_tokens`) and, of those,
# the tokens restored from the tier (`restored_tokens`).
ADDED_IN = {2: ("pages_selected", "pages_visible"),
            3: ("cached_tokens", "restored_tokens", "tier_bytes", "tier_hit_pages", "tier_asked_pages")}

_FIELDS = [
    ("schema_version", pa.uint16(), False),
    ("seq", pa.int64(), False),        # 1, 2, ... per stream file, in write order
    ("t_ns", pa.int64(), False),       # event time; for span/step/end: the end
    ("kind", pa.string(), False),
    ("role", pa.string(), False),
    ("server", pa.string(), False),    # "<role>-<instance>"
    ("phase", pa.string(), True),
    ("rid", pa.string(), True),        # request id on this server
    ("room", pa.int64(), True),        # bootstrap_room: joins prefill and decode
    ("dur_ns", pa.int64(), True),      # span / step length
    ("bytes", pa.int64(), True),       # transfer: bytes on the wire
    ("bytes_bf16", pa.int64(), True),  # transfer or sample: the BF16-equivalent bytes
    ("tokens", pa.int64(), True),      # arrival: prompt; finish/span decode: output tokens
    ("method", pa.string(), True),
    ("note", pa.string(), True),       # error message, attribution detail
    ("cached_tokens", pa.int64(), True),    # prefill end: prompt tokens not computed (version 3)
    ("restored_tokens", pa.int64(), True),  # prefill end: of those, restored from the page tier
] + [(name, pa.int64(), True) for name in SAMPLE_FIELDS if name != "bytes_bf16"]

COLUMNS = tuple(name for name, _, _ in _FIELDS)


def arrow_schema() -> pa.Schema:
    """The Arrow schema of the current version, with its version in the metadata."""
    fields = [pa.field(name, typ, nullable=nullable) for name, typ, nullable in _FIELDS]
    return pa.schema(fields, metadata={VERSION_KEY: str(SCHEMA_VERSION).encode()})


class SchemaVersionError(ValueError):
    """A stream was written with a schema version this code does not understand."""


def schema_version_of(schema: pa.Schema) -> int | None:
    """The version recorded in a stream's schema metadata, or None if absent."""
    meta = schema.metadata or {}
    raw = meta.get(VERSION_KEY)
    if raw is None:
        return None
    try:
        return int(raw.decode())
    except ValueError:
        return None


def check_schema(schema: pa.Schema, source: str = "stream") -> int:
    """Return the version of `schema`, or raise SchemaVersionError with a clear message."""
    version = schema_version_of(schema)
    if version is None:
        raise SchemaVersionError(
            f"{source}: no '{VERSION_KEY.decode()}' in the Arrow schema metadata; "
            "this is not a HACK metrics stream")
    if version not in SUPPORTED_VERSIONS:
        known = ", ".join(str(v) for v in sorted(SUPPORTED_VERSIONS))
        raise SchemaVersionError(
            f"{source}: metrics schema version {version} is not supported "
            f"(this code reads version {known}); upgrade sglang-hack to read it")
    missing = [c for c in columns_of(version) if c not in schema.names]
    if missing:
        raise SchemaVersionError(f"{source}: schema version {version} but columns "
                                 f"{missing} are missing")
    return version


def validate_record(row: dict) -> None:
    """Raise ValueError if a record's kind/phase/role/method is not part of the schema."""
    kind = row.get("kind")
    if kind not in KINDS:
        raise ValueError(f"unknown metrics kind {kind!r}; expected one of {KINDS}")
    phase = row.get("phase")
    if kind in BOUNDARY_KINDS + ("span", "step") and phase not in PHASES:
        raise ValueError(f"kind {kind!r} needs a phase in {PHASES}, got {phase!r}")
    if phase is not None and phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
    if row.get("role") not in ROLES:
        raise ValueError(f"unknown role {row.get('role')!r}; expected one of {ROLES}")
    method = row.get("method")
    if method is not None and method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if kind in ("span", "step") and row.get("dur_ns") is None:
        raise ValueError(f"kind {kind!r} needs dur_ns")
    if kind != "sample" and kind != "error" and row.get("rid") is None \
            and row.get("room") is None:
        raise ValueError(f"kind {kind!r} needs a rid or a room")


def columns_of(version: int) -> tuple[str, ...]:
    """The columns a stream of `version` holds (later versions only add columns)."""
    later = {c for v, cols in ADDED_IN.items() if v > version for c in cols}
    return tuple(c for c in COLUMNS if c not in later)


def conform(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A batch of an older supported version in the current schema: the columns its version
    lacks are added as nulls, so readers see one schema whatever wrote the stream."""
    if batch.schema.names == list(COLUMNS):
        return batch
    schema = arrow_schema()
    cols = [batch.column(name) if name in batch.schema.names else pa.nulls(batch.num_rows, schema.field(name).type)
            for name in COLUMNS]
    return pa.RecordBatch.from_arrays(cols, schema=schema)
