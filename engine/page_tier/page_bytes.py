"""One KV page of a pool as bytes, and back: what the page tier stores per page.

A page of a HACK pool is, for every layer, its K page and V page rows exactly as the pool holds
them (codes, side tables and K's code sums; per-layer bits give per-layer widths). A sequence's
first page also owns the sequence's FP16 sinks (hack_ops.paged.store keys them by the first
page): those travel as a second, smaller record. A page of SGLang's own token pool (BF16, the
baseline) is its Π token rows of K and V per layer.

Each record is sealed with a header (magic, version, flags, payload size) and a BLAKE2b digest
over the key, header and payload, so a record that was truncated, damaged or stored under
another key is refused, never written into the pool.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

MAGIC = b"HKT1"
_HEADER = struct.Struct("<4sBBHQ")  # magic, version, flags, reserved, payload bytes
_VERSION = 1
_DIGEST = 16
FLAG_FIRST_PAGE = 1  # the page starts a sequence: its sinks are stored beside it
SINK_SUFFIX = ".sinks"  # the key of a first page's sinks record: the page's key + this


class DamagedRecord(ValueError):
    """A stored record that does not hold what its key says (size, header or digest)."""


def sealed_size(payload_bytes: int) -> int:
    return _HEADER.size + payload_bytes + _DIGEST


def _digest(key: str, head: bytes, payload: memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST)
    h.update(key.encode())
    h.update(head)
    h.update(payload)
    return h.digest()


def seal(key: str, payload: Tensor, flags: int = 0) -> Tensor:
    """`payload` (uint8, on the CPU) framed for `key`: header, payload, digest."""
    body = payload.contiguous().view(torch.uint8).reshape(-1).cpu()
    head = _HEADER.pack(MAGIC, _VERSION, flags, 0, body.numel())
    out = torch.empty(sealed_size(body.numel()), dtype=torch.uint8)
    raw = out.numpy()
    raw[:_HEADER.size] = memoryview(head)
    raw[_HEADER.size:_HEADER.size + body.numel()] = body.numpy()
    raw[-_DIGEST:] = memoryview(_digest(key, head, memoryview(body.numpy())))
    return out


def unseal(key: str, record: Tensor, payload_bytes: int) -> tuple[Tensor, int]:
    """The payload and flags of a record `seal` wrote for `key`; DamagedRecord otherwise."""
    raw = record.view(torch.uint8).reshape(-1).numpy()
    if raw.size != sealed_size(payload_bytes):
        raise DamagedRecord(f"{raw.size} bytes, expected {sealed_size(payload_bytes)}")
    magic, version, flags, _, size = _HEADER.unpack(raw[:_HEADER.size].tobytes())
    if magic != MAGIC or version != _VERSION or size != payload_bytes:
        raise DamagedRecord(f"header {magic!r} v{version} of {size} bytes")
    body = raw[_HEADER.size:_HEADER.size + payload_bytes]
    if _digest(key, raw[:_HEADER.size].tobytes(), memoryview(body)) != raw[-_DIGEST:].tobytes():
        raise DamagedRecord("digest mismatch")
    return torch.from_numpy(body), int(flags)


class PageFormat(Protocol):
    """How one pool's pages become bytes. Page ids are SGLang's (slot // page size)."""

    namespace: str  # differs whenever the bytes of a page would mean something else
    page_bytes: int  # payload bytes of one page, every layer
    sink_bytes: int  # payload bytes of a first page's sinks (0: the format keeps none)

    def read_page(self, page: int) -> Tensor: ...
    def write_page(self, page: int, payload: Tensor) -> None: ...
    def first_page(self, page: int) -> bool: ...
    def read_sinks(self, page: int) -> Tensor: ...
    def write_sinks(self, page: int, payload: Tensor) -> None: ...


def _namespace(kind: str, model: str, desc: dict) -> str:
    digest = hashlib.blake2b(json.dumps({"model": model, **desc}, sort_keys=True).encode(),
                             digest_size=6).hexdigest()
    return f"{kind}-{digest}"


def _concat(parts: list[Tensor]) -> Tensor:
    return torch.cat([p.contiguous().view(torch.uint8).reshape(-1).cpu() for p in parts])


def _scatter(payload: Tensor, targets: list[Tensor]) -> None:
    """Copy `payload` bytes into `targets` (views of the pool), in order."""
    off = 0
    for t in targets:
        n = t.numel() * t.element_size()
        t.copy_(payload[off:off + n].view(t.dtype).reshape(t.shape).to(t.device))
        off += n
    if off != payload.numel():
        raise DamagedRecord(f"payload of {payload.numel()} bytes for {off} bytes of pages")


class _RowPages:
    """A page is a list of row views of the pool (`_rows`); its bytes are theirs, in order."""

    def _rows(self, page: int) -> list[Tensor]:
        raise NotImplementedError

    def read_page(self, page: int) -> Tensor:
        return _concat(self._rows(page))

    def write_page(self, page: int, payload: Tensor) -> None:
        _scatter(payload, self._rows(page))


@dataclass
class HackPages(_RowPages):
    """Pages of a HackKVPool's store (engine.pool)."""

    store: Any  # hack_ops.paged.store.HackKVStore
    namespace: str

    @classmethod
    def of(cls, pool: Any, model: str) -> "HackPages":
        from hack_ops.layout import describe_layouts

        desc = {**describe_layouts(pool.store), "layers": pool.layer_num, "heads": pool.head_num,
                "head_dim": pool.head_dim}
        return cls(pool.store, _namespace("hack", model, desc))

    @property
    def page_bytes(self) -> int:
        return sum(b.shape[1] for b in self.store.k_pages) + sum(b.shape[1] for b in self.store.v_pages)

    @property
    def sink_bytes(self) -> int:
        if not self.store.num_sink_slots:
            return 0
        return sum(t[0].numel() * t.element_size() for t in (*self.store.sink_k, *self.store.sink_v))

    def _rows(self, page: int) -> list[Tensor]:
        return [b[page] for b in self.store.k_pages] + [b[page] for b in self.store.v_pages]

    def first_page(self, page: int) -> bool:
        return bool(self.store.num_sink_slots) and int(self.store.sink_map[page]) >= 0

    def _sink_rows(self, slot: int) -> list[Tensor]:
        return [t[slot] for t in self.store.sink_k] + [t[slot] for t in self.store.sink_v]

    def read_sinks(self, page: int) -> Tensor:
        return _concat(self._sink_rows(int(self.store.sink_map[page])))

    def write_sinks(self, page: int, payload: Tensor) -> None:
        slot = int(self.store.sink_slots_for(torch.tensor([page]), allocate=True)[0])
        _scatter(payload, self._sink_rows(slot))


@dataclass
class TokenPages(_RowPages):
    """Pages of SGLang's MHATokenToKVPool (the BF16 baseline): Π token rows of K and V per layer."""

    pool: Any
    page_size: int
    namespace: str
    sink_bytes: int = 0

    @classmethod
    def of(cls, pool: Any, model: str) -> "TokenPages":
        desc = {"dtype": str(pool.store_dtype), "layers": pool.layer_num, "heads": pool.head_num,
                "head_dim": pool.head_dim, "page": pool.page_size}
        return cls(pool, pool.page_size, _namespace("tokens", model, desc))

    @property
    def page_bytes(self) -> int:
        return sum(b[:self.page_size].numel() * b.element_size() for b in (*self.pool.k_buffer, *self.pool.v_buffer))

    def _rows(self, page: int) -> list[Tensor]:
        s = slice(page * self.page_size, (page + 1) * self.page_size)
        return [b[s] for b in self.pool.k_buffer] + [b[s] for b in self.pool.v_buffer]

    def first_page(self, page: int) -> bool:
        return False

    def read_sinks(self, page: int) -> Tensor:
        raise AssertionError("a token pool keeps no sinks")

    def write_sinks(self, page: int, payload: Tensor) -> None:
        raise AssertionError("a token pool keeps no sinks")


class UnsupportedPool(ValueError):
    """A KV pool the page tier cannot store (said at startup)."""


def page_format(pool: Any, model: str) -> PageFormat:
    """The page format of `pool`: HACK pages, or SGLang's plain token pool; else UnsupportedPool."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from ..pool import HackKVPool

    if isinstance(pool, HackKVPool):
        return HackPages.of(pool, model)
    if type(pool) is MHATokenToKVPool:
        return TokenPages.of(pool, model)
    raise UnsupportedPool(
        f"the page tier stores HACK pages and SGLang's plain MHA token pool; this server's KV pool is "
        f"{type(pool).__name__} (a model with sliding-window layers: add --disable-hybrid-swa-memory)")
