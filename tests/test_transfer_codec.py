"""The SplitZip codec on the PD transfer path (disagg.transfer_codec), without servers: a
prefill-side PageCodec sends pages through a fake transfer engine (memmove between registered
buffers, as Mooncake writes them) into a decode-side pool, which decodes them in place."""
from __future__ import annotations

import argparse
import ctypes
from types import SimpleNamespace

import pytest
import torch

from disagg import checksum, connector, transfer_codec
from disagg.transfer_codec import KvCodec, PageCodec
from hack_ops.codec import codebook as cb
from hack_ops.codec.format import FloatFormat

LAYERS, PAGE, HEADS, DIM, PAGES = 3, 16, 2, 64, 12


class FakeEngine:
    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.bytes = 0

    def register(self, ptr: int, length: int) -> None:
        self.registered.append((ptr, length))


class FakeManager:
    """What PageCodec.send uses of MooncakeKVManager: kv_args, engine, _transfer_data."""

    def __init__(self, kv_data_ptrs: list[int]) -> None:
        self.kv_args = SimpleNamespace(kv_data_ptrs=kv_data_ptrs)
        self.engine = FakeEngine()
        self.calls = 0

    def _transfer_data(self, session_id: str, blocks: list) -> int:
        self.calls += 1
        for src, dst, n in blocks:
            ctypes.memmove(dst, src, n)
            self.engine.bytes += n
        return 0


def _pool(seed: int, scale: float = 0.3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(PAGES * PAGE, HEADS, DIM, generator=g) * scale).to(torch.bfloat16)
            for _ in range(2 * LAYERS)]


def _pair(src_bufs: list[torch.Tensor], dst_bufs: list[torch.Tensor]):
    book = cb.default(FloatFormat.BF16)
    item = PAGE * HEADS * DIM * 2
    pre = PageCodec(book, [b.data_ptr() for b in src_bufs], [item] * len(src_bufs), PAGES)
    dec = PageCodec(book, [b.data_ptr() for b in dst_bufs], [item] * len(dst_bufs), PAGES)
    mgr = FakeManager([b.data_ptr() for b in src_bufs] + [pre.header.data_ptr()])
    dst_ptrs = [b.data_ptr() for b in dst_bufs] + [dec.header.data_ptr()]
    return pre, dec, mgr, dst_ptrs


def _page(buf: torch.Tensor, p: int) -> torch.Tensor:
    return buf[p * PAGE:(p + 1) * PAGE]


def test_pages_arrive_bitwise_and_smaller() -> None:
    src, dst = _pool(0), [torch.zeros(PAGES * PAGE, HEADS, DIM, dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    # one incompressible page (random bits) goes raw
    _page(src[1], 2).view(torch.int16).copy_(torch.randint(-32768, 32768, (PAGE, HEADS, DIM),
                                                           generator=torch.Generator().manual_seed(1),
                                                           dtype=torch.int32).to(torch.int16))
    pre, dec, mgr, dst_ptrs = _pair(src, dst)
    src_pages, dst_pages = [1, 2, 5], [7, 3, 4]
    assert pre.send(mgr, "s", src_pages, dst_ptrs, dst_pages) == 0
    assert mgr.engine.registered == [(pre.staging.data_ptr(), pre.staging.nbytes)]
    assert pre.stats["raw_pages"] == 1
    raw = len(src_pages) * 2 * LAYERS * PAGE * HEADS * DIM * 2
    assert mgr.engine.bytes < 0.78 * raw + 3 * 40  # plus one header row per page
    assert dec.decode_pages(dst_pages) == 0
    for s, d in zip(src, dst):
        for sp, dp in zip(src_pages, dst_pages):
            assert torch.equal(_page(s, sp).view(torch.int16), _page(d, dp).view(torch.int16))
    assert int(dec.header[dst_pages].abs().sum()) == 0  # cleared after decoding


def test_a_damaged_stream_fills_its_page_so_the_digest_fails() -> None:
    src, dst = _pool(2), [torch.zeros(PAGES * PAGE, HEADS, DIM, dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    pre, dec, mgr, dst_ptrs = _pair(src, dst)
    assert pre.send(mgr, "s", [0, 1], dst_ptrs, [0, 1]) == 0
    computer = SimpleNamespace(_kv_data_ptrs=[b.data_ptr() for b in src], _kv_item_lens=[PAGE * HEADS * DIM * 2] * 6,
                               _state_data_ptrs=[], _state_item_lens=[])
    want = checksum.compute(computer, torch.tensor([0, 1]))
    _page(dst[0], 1).view(torch.uint8).view(-1)[0] ^= 0x5A  # the stream's magic
    assert dec.decode_pages([0, 1]) == 1
    assert bool((_page(dst[0], 1).view(torch.uint8) == 0xFF).all())
    computer._kv_data_ptrs = [b.data_ptr() for b in dst]
    assert checksum.compute(computer, torch.tensor([0, 1])) != want


def test_digest_skips_the_header_table() -> None:
    src = _pool(3)
    book = cb.default(FloatFormat.BF16)
    item = PAGE * HEADS * DIM * 2
    codec = PageCodec(book, [b.data_ptr() for b in src], [item] * 6, PAGES)
    transfer_codec._codec[:] = [codec]
    try:
        comp = SimpleNamespace(_kv_data_ptrs=[b.data_ptr() for b in src] + [codec.header.data_ptr()],
                               _kv_item_lens=[item] * 6 + [codec.row_bytes], _state_data_ptrs=[], _state_item_lens=[])
        before = checksum.compute(comp, torch.tensor([3]))
        codec.header.fill_(7)
        assert checksum.compute(comp, torch.tensor([3])) == before
    finally:
        transfer_codec._codec[:] = []


def _ns(**kw) -> argparse.Namespace:
    base = dict(hack_kv_codec="splitzip", disaggregation_mode="prefill", disaggregation_transfer_backend="mooncake_tcp",
                disaggregation_enable_kv_checksum=True, kv_cache_dtype="auto", dtype="bfloat16")
    return argparse.Namespace(**{**base, **kw})


def test_server_options_are_checked_with_a_sentence() -> None:
    assert transfer_codec.check_options(_ns()) is KvCodec.SPLITZIP
    assert transfer_codec.check_options(_ns(hack_kv_codec=None)) is KvCodec.NONE
    for bad, words in ((dict(disaggregation_mode="null"), "--disaggregation-mode"),
                       (dict(disaggregation_transfer_backend="nixl"), "Mooncake"),
                       (dict(disaggregation_enable_kv_checksum=False), "--disaggregation-enable-kv-checksum"),
                       (dict(kv_cache_dtype="hack"), "16-bit"),
                       (dict(kv_cache_dtype="fp8_e4m3"), "16-bit"),
                       (dict(dtype="float32"), "16-bit")):
        with pytest.raises(ValueError, match=words):
            transfer_codec.check_options(_ns(**bad))


def test_codec_mismatch_sentence() -> None:
    msg = ("prefill server has kv_cache_dtype=bfloat16+splitzip:e313571b, but decode server has "
           "kv_cache_dtype=bfloat16. Please ...")
    reason = connector.incompatible_reason(msg, "10.0.0.2:8998")
    assert "prefill uses KV transfer codec splitzip (codebook e313571b)" in reason
    assert "decode uses no KV transfer codec" in reason and "--hack-kv-codec" in reason
    msg = ("prefill server has kv_cache_dtype=bfloat16+splitzip:e313571b, but decode server has "
           "kv_cache_dtype=bfloat16+splitzip:0badf00d. x")
    assert "codebook 0badf00d" in connector.incompatible_reason(msg, "a")


def test_server_commands_of_the_new_methods() -> None:
    from disagg.server_cmd import server_command

    pre = server_command("prefill", "bf16-lossless", "/m", "h", 1, 2, 100)
    assert pre[pre.index("--hack-kv-codec") + 1] == "splitzip" and "--disaggregation-enable-kv-checksum" in pre
    assert "--hack-kv-codec" not in server_command("colocated", "bf16-lossless", "/m", "h", 1, None, 100)
    fp8 = server_command("decode", "fp8", "/m", "h", 1, None, 100)
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
