"""SplitZip on the prefill->decode KV transfer (`--hack-kv-codec splitzip`, method bf16-lossless).

Mooncake's transfer engine writes registered memory to registered memory: SGLang sends every
KV page as `item_len` bytes from the prefill pool straight into the decode pool. With the
codec on, the prefill side replaces that send (hook around MooncakeKVManager.send_kvcache):
  - each (layer, K|V, page) is coded on the CPU (hack_ops.codec, one page = one stream) into a
    registered staging buffer; the coded bytes are written to the start of the decode pool's
    destination page (a page whose stream would not be smaller is sent raw, from the pool);
  - a small page header table, registered as one more KV buffer (one row per page: for every
    layer's K and V, the stream length and whether it is coded), travels with the pages.
On the decode side, before the request's first step (hook before _verify_kv_checksums, so
the digest is computed over the decoded bytes), every coded page is copied out of the pool
page and decoded back into it. A stream that cannot be decoded fills its page with 0xFF
bytes, so the digest check fails the request ("KV checksum mismatch") and SGLang frees its
pages on both sides; for that reason the codec requires --disaggregation-enable-kv-checksum.
Both sides put `+splitzip:<codebook id>` into the KV dtype string compared at bootstrap, so a
pairing whose codec or codebook differs is refused with a sentence (disagg.connector).

This module also owns the option for the other member, `hack-pages` (HACK pages without their
derived bytes, disagg.hack_wire): one flag, one set of checks, one fingerprint vocabulary.
"""
from __future__ import annotations

import ctypes
import enum
import logging
import os
import threading
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "SGLANG_HACK_KV_CODEC"
FINGERPRINT_TAG = "+splitzip:"
HACK_PAGES_TAG = "+hack-pages:"  # followed by the transform's version (disagg.hack_wire)
_TAGS = (FINGERPRINT_TAG, HACK_PAGES_TAG)
STAGING_BYTES = 64 << 20  # coded streams per transfer batch; flushed when full
MAX_BATCH_BLOCKS = 512  # pages per synchronous transfer call (one batch of thousands of small
# writes failed over a 100 Mbit/s link; SGLang's own path sends few, contiguous blocks)
HEADER_WORDS = 2  # per (page, entry): int32 stream length, int32 mode


class KvCodec(enum.Enum):
    NONE = "none"
    SPLITZIP = "splitzip"  # 16-bit (BF16/FP16) pages, SplitZip-coded
    HACK_PAGES = "hack-pages"  # HACK pages without K's code sums and the unread open page


class PageMode(enum.IntEnum):
    RAW = 0  # sent as is (or never coded)
    CODED = 1


def add_arguments(parser: Any) -> None:
    if "--hack-kv-codec" in parser._option_string_actions:
        return
    parser.add_argument(
        "--hack-kv-codec", dest="hack_kv_codec", default=None, choices=[c.value for c in KvCodec],
        help="Lossless codec for the KV pages a prefill server sends to decode. splitzip: 16-bit "
             "KV coded to ~75%% with the model folder's kv_codebook.json (see `hack codec "
             "calibrate`); hack-pages (--kv-cache-dtype hack): pages sent without K's code sums, "
             "which decode recomputes from the codes, and without the open partition's page, "
             "which decode does not read; none (the default): pages sent as stored. Both sides "
             "of a pairing must use the same codec.")


def check_options(ns: Any) -> KvCodec:
    """The codec a parsed namespace asks for; ValueError (one sentence) for a combination that
    cannot work, before the model loads."""
    codec = KvCodec(getattr(ns, "hack_kv_codec", None) or KvCodec.NONE.value)
    if codec is KvCodec.NONE:
        return codec
    mode = getattr(ns, "disaggregation_mode", "null")
    if mode not in ("prefill", "decode"):
        raise ValueError("--hack-kv-codec codes the prefill->decode KV transfer; it needs "
                         f"--disaggregation-mode prefill or decode (got {mode})")
    backend = getattr(ns, "disaggregation_transfer_backend", None)
    if backend not in ("mooncake", "mooncake_tcp"):
        raise ValueError(f"--hack-kv-codec rides the Mooncake transfer engine; got "
                         f"--disaggregation-transfer-backend {backend}")
    kv = getattr(ns, "kv_cache_dtype", "auto")
    if codec is KvCodec.HACK_PAGES:
        if kv != "hack":
            raise ValueError(f"--hack-kv-codec hack-pages sends HACK pages; it needs --kv-cache-dtype "
                             f"hack (got {kv}; for 16-bit KV use --hack-kv-codec splitzip)")
        return codec
    if not getattr(ns, "disaggregation_enable_kv_checksum", False):
        raise ValueError("--hack-kv-codec needs --disaggregation-enable-kv-checksum: a coded page "
                         "that cannot be decoded fails its request through the digest check")
    if kv not in ("auto", "bfloat16", "bf16", "float16", "fp16"):
        hint = " (for --kv-cache-dtype hack use --hack-kv-codec hack-pages)" if kv == "hack" else ""
        raise ValueError(f"--hack-kv-codec splitzip codes 16-bit KV pages; --kv-cache-dtype {kv} is "
                         f"not{hint}")
    dtype = getattr(ns, "dtype", "auto")
    if kv == "auto" and dtype not in ("auto", "bfloat16", "float16", "half"):
        raise ValueError(f"--hack-kv-codec codes 16-bit KV pages; --dtype {dtype} is not")
    return codec


def publish(codec: KvCodec) -> None:
    """The scheduler processes are started after the CLI is parsed and inherit this."""
    os.environ[ENV_VAR] = codec.value


def active() -> KvCodec:
    try:
        return KvCodec(os.environ.get(ENV_VAR, KvCodec.NONE.value))
    except ValueError:
        raise ValueError(f"{ENV_VAR} must be one of {[c.value for c in KvCodec]}") from None


def describe(tag: str) -> str:
    """'+splitzip:<id>' or '+hack-pages:<version>' -> words for a mismatch message."""
    if tag.startswith(FINGERPRINT_TAG):
        return f"KV transfer codec splitzip (codebook {tag[len(FINGERPRINT_TAG):]})"
    if tag.startswith(HACK_PAGES_TAG):
        return f"KV transfer codec hack-pages (version {tag[len(HACK_PAGES_TAG):]})"
    return "no KV transfer codec"


def split_fingerprint(fp: str) -> tuple[str, str]:
    """(the KV format, the codec tag or '')."""
    cut = min((i for i in (fp.find(t) for t in _TAGS) if i >= 0), default=-1)
    return (fp, "") if cut < 0 else (fp[:cut], fp[cut:])


class PageCodec:
    """Per scheduler process: the codebook, the page header table and (prefill) the staging buffer."""

    def __init__(self, book: Any, ptrs: list[int], item_lens: list[int], num_pages: int) -> None:
        from hack_ops.codec import cpu

        self.book = book
        self.lib = cpu.load()
        if self.lib is None:
            raise RuntimeError(f"--hack-kv-codec splitzip needs the compiled codec: {cpu.why_not()}")
        self.tab = bytes(book.exponents)
        self.ptrs = list(ptrs)
        self.item_lens = list(item_lens)
        self.entries = len(ptrs)
        self.header = torch.zeros((num_pages, self.entries, HEADER_WORDS), dtype=torch.int32)
        self._hdr = self.header.numpy()  # same memory; cheaper element access than the tensor
        self.row_bytes = self.entries * HEADER_WORDS * 4
        self.lock = threading.Lock()
        self.staging: torch.Tensor | None = None
        self.scratch = torch.zeros(max(item_lens), dtype=torch.uint8)
        self.stats = {"pages": 0, "raw_pages": 0, "bytes_in": 0, "bytes_out": 0, "encode_s": 0.0,
                      "decode_s": 0.0, "failed": 0}

    # ---- prefill ----
    def _staging(self, manager: Any) -> torch.Tensor:
        if self.staging is None:
            buf = torch.zeros(STAGING_BYTES, dtype=torch.uint8)  # touched: no page faults later
            manager.engine.register(buf.data_ptr(), buf.nbytes)
            self.staging = buf
        return self.staging

    def send(self, manager: Any, session_id: str, src_pages: Any, dst_ptrs: list[int], dst_pages: Any) -> int:
        """Code and send one chunk's pages; 0 on success (the transfer engine's convention)."""
        if len(dst_ptrs) != self.entries + 1:
            logger.error("decode registered %d KV buffers, this prefill codes %d + a header table",
                         len(dst_ptrs), self.entries)
            return -1
        src = [int(p) for p in src_pages]
        dst = [int(d) for d in dst_pages]
        hdr_src, hdr_dst = int(manager.kv_args.kv_data_ptrs[self.entries]), int(dst_ptrs[self.entries])
        with self.lock:
            stage = self._staging(manager)
            base, cap = stage.data_ptr(), stage.nbytes
            off = 0
            blocks: list[tuple[int, int, int]] = []
            t0 = time.perf_counter()
            enc_s = 0.0
            for e in range(self.entries):
                item = self.item_lens[e]
                for p, d in zip(src, dst):
                    if off + item > cap or len(blocks) >= MAX_BATCH_BLOCKS:
                        enc_s += time.perf_counter() - t0
                        ret = manager._transfer_data(session_id, blocks)
                        if ret != 0:
                            return ret
                        t0 = time.perf_counter()
                        blocks, off = [], 0
                    sp, dp = self.ptrs[e] + p * item, int(dst_ptrs[e]) + d * item
                    n = self.lib.sz_encode(sp, item // 2, int(self.book.fmt), self.tab, self.book.ident,
                                           4096, base + off, item - 1, 1)
                    self.stats["pages"] += 1
                    self.stats["bytes_in"] += item
                    if n < 0:  # would not be smaller than the page: send it raw
                        blocks.append((sp, dp, item))
                        self._hdr[p, e] = (item, PageMode.RAW)
                        self.stats["raw_pages"] += 1
                        self.stats["bytes_out"] += item
                    else:
                        blocks.append((base + off, dp, int(n)))
                        self._hdr[p, e] = (int(n), PageMode.CODED)
                        off += int(n)
                        self.stats["bytes_out"] += int(n)
            for p, d in zip(src, dst):
                blocks.append((hdr_src + p * self.row_bytes, hdr_dst + d * self.row_bytes, self.row_bytes))
            enc_s += time.perf_counter() - t0
            self.stats["encode_s"] += enc_s
            return manager._transfer_data(session_id, blocks)

    # ---- decode ----
    def decode_pages(self, pages: list[int]) -> int:
        """Decode every coded page in place; returns how many could not be decoded (filled
        with 0xFF so that the digest check fails their request)."""
        failed = 0
        t0 = time.perf_counter()
        scratch = self.scratch.data_ptr()
        for p in pages:
            row = self._hdr[p]
            for e in range(self.entries):
                length, mode = int(row[e, 0]), int(row[e, 1])
                if mode == PageMode.RAW:
                    continue
                item = self.item_lens[e]
                addr = self.ptrs[e] + p * item
                ok = mode == PageMode.CODED and 0 < length < item
                if ok:
                    ctypes.memmove(scratch, addr, length)
                    ok = self.lib.sz_decode(scratch, length, int(self.book.fmt), self.tab, self.book.ident,
                                            addr, item // 2, 1) == 0
                if not ok:
                    ctypes.memset(addr, 0xFF, item)
                    failed += 1
            row[:] = 0  # a page that is not sent again must not be decoded again
        self.stats["decode_s"] += time.perf_counter() - t0
        self.stats["failed"] += failed
        return failed


_codec: list[PageCodec] = []  # one per scheduler process (set at setup, read by the hooks)


def current() -> PageCodec | None:
    return _codec[0] if _codec else None


def header_ptrs() -> set[int]:
    """Addresses of header tables: not KV, so not part of the digest."""
    return {c.header.data_ptr() for c in _codec}


def attach(kv_args: Any, pool: Any, model_path: str | None) -> PageCodec:
    """Describe the header table to the transfer engine (one more KV buffer, registered and
    exchanged at bootstrap like the pages) and tag the KV format with the codec."""
    from hack_ops.codec import for_model
    from hack_ops.codec.format import FloatFormat

    dtype = pool.k_buffer[0].dtype if hasattr(pool, "k_buffer") else None
    if dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeError(f"--hack-kv-codec splitzip codes BF16/FP16 KV pages; this pool stores {dtype}")
    books = for_model(model_path)
    book = books.get(FloatFormat.of(dtype))
    ptrs, lens, items = list(kv_args.kv_data_ptrs), list(kv_args.kv_data_lens), list(kv_args.kv_item_lens)
    if not ptrs or any(i % 2 for i in items):
        raise RuntimeError("--hack-kv-codec splitzip: the pool describes no 16-bit KV pages to code")
    codec = PageCodec(book, ptrs, items, lens[0] // items[0])
    kv_args.kv_data_ptrs = ptrs + [codec.header.data_ptr()]
    kv_args.kv_data_lens = lens + [codec.header.nbytes]
    kv_args.kv_item_lens = items + [codec.row_bytes]
    kv_args.kv_cache_dtype_str = f"{kv_args.kv_cache_dtype_str}{FINGERPRINT_TAG}{book.ident:08x}"
    _codec[:] = [codec]
    logger.info("sglang-hack PD: KV pages coded with SplitZip (%s codebook %s, %s); format %s",
                book.fmt.name, f"{book.ident:08x}", books.source, kv_args.kv_cache_dtype_str)
    return codec
