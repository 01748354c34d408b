"""A CPU digest of the KV a request moves, for SGLang's `--disaggregation-enable-kv-checksum`.

SGLang ships the digest and its comparison (prefill puts a digest of the pages and state rows
it sends in the request's metadata row; decode digests what landed and drops the request on a
mismatch with "KV checksum mismatch"), but computes it with a CUDA kernel. On a host without a
GPU this module computes the same kind of digest with zlib's CRC-32 over the same
(buffer, item length, indices) triples, reading the registered buffers by address, as the
transfer engine itself does. A flipped bit or a page that never arrived (truncation) changes
it; the item count and lengths are folded in so a short transfer cannot collide with a long one.
"""
from __future__ import annotations

import ctypes
import struct
import zlib
from typing import Sequence

import torch


def _ints(indices: torch.Tensor | Sequence[int] | None) -> list[int]:
    if indices is None:
        return []
    if isinstance(indices, torch.Tensor):
        return [int(x) for x in indices.reshape(-1).tolist()]
    return [int(x) for x in indices]


def digest_items(ptrs: Sequence[int], item_lens: Sequence[int],
                 indices_per_ptr: Sequence[Sequence[int]]) -> int:
    """CRC-32 chained over buffer[i * item_len : (i + 1) * item_len] for every buffer and
    index, in order. Returns a positive 63-bit value that is never 0 (0 means "no digest")."""
    crc = 0
    count = 0
    for ptr, item_len, idx in zip(ptrs, item_lens, indices_per_ptr):
        crc = zlib.crc32(struct.pack("<qq", int(item_len), len(idx)), crc)
        for i in idx:
            buf = (ctypes.c_char * item_len).from_address(int(ptr) + i * int(item_len))
            crc = zlib.crc32(memoryview(buf), crc)
            count += 1
    return ((count & 0x3FFFFFFF) << 33) | (crc << 1) | 1


def compute(computer, kv_page_indices: torch.Tensor, state_indices: torch.Tensor | None = None,
            per_buffer: dict[int, list[int]] | None = None) -> int:
    """Replacement body of sglang's KvChecksumComputer.compute for CPU tensors. per_buffer: the
    pages a K/V buffer's digest covers where they are not all of kv_page_indices (static
    eviction: the pages its layer sent), by buffer address."""
    pages = _ints(kv_page_indices)
    from .transfer_codec import header_ptrs

    skip = header_ptrs()  # the codec's page headers are not KV: the digest covers decoded pages
    kv = [(p, n) for p, n in zip(computer._kv_data_ptrs, computer._kv_item_lens) if int(p) not in skip]
    ptrs = [p for p, _ in kv]
    lens = [n for _, n in kv]
    idx: list[list[int]] = [(per_buffer or {}).get(int(p), pages) for p in ptrs]
    if computer._state_data_ptrs:
        sptrs = list(computer._state_data_ptrs)
        slens = list(computer._state_item_lens)
        if hasattr(state_indices, "num_tail"):  # disagg.pd_state.HackStateIndices
            hs = state_indices
            for p, item in zip(sptrs[:hs.num_tail], slens[:hs.num_tail]):
                # Only the live slots of the tail row travel; the rest of the row differs.
                ptrs.append(p + hs.row * item)
                lens.append(item // hs.page_size * hs.live)
                idx.append([0] if hs.live else [])
            ptrs += sptrs[hs.num_tail:]
            lens += slens[hs.num_tail:]
            idx += [[hs.row]] * (len(sptrs) - hs.num_tail)
        else:
            rows = _ints(state_indices)
            ptrs += sptrs
            lens += slens
            idx += [rows] * len(sptrs)
    return digest_items(ptrs, lens, idx)
