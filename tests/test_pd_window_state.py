"""What the PD transfer moves is all a window layer needs, without servers: a Gemma-shaped
request (1 KV head, head_dim 256, 700 tokens past a 511 window) is prefilled into one store,
its page items, live FP16 tail slots and sinks are moved the way the PD path moves them
(disagg.pd_state's buffers and sink staging) into another store at other pages and another
row, and decode there equals decode on the source, bit for bit, for window and full layers."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from disagg.pd_state import SinkStaging, install_received_sinks, sink_buffers, stage_sinks_for_send, tail_buffers
from hack_ops import HackConfig
from hack_ops.paged.attention import decode, extend
from hack_ops.paged.store import HackKVStore

LAYERS, HEADS, Q_HEADS, DIM, PAGE = 2, 1, 4, 256, 64
WINDOWS = (511, None)  # layer 0: Gemma-3's sliding window; layer 1: a full layer
N = 700  # 10 closed pages + a 60-token open partition; the window drops the first 189 keys


def _side(first_page: int, row: int) -> tuple[SimpleNamespace, torch.Tensor]:
    store = HackKVStore(HackConfig(), LAYERS, HEADS, DIM, num_pages=40, num_rows=4)
    r2t = torch.zeros(4, 1024, dtype=torch.int64)
    r2t[row] = torch.arange(1024) + first_page * PAGE
    return SimpleNamespace(store=store, disagg_sink_staging=SinkStaging.for_store(store), page_size=PAGE), r2t


@pytest.fixture(scope="module")
def source():
    """The prefilled source side (the expensive part, shared by both tests) and the inputs."""
    g = torch.Generator().manual_seed(12)
    k, v = torch.randn(N + 1, HEADS, DIM, generator=g), torch.randn(N + 1, HEADS, DIM, generator=g)
    q = torch.randn(N + 1, Q_HEADS, DIM, generator=g)
    src, r2t = _side(3, 1)
    for layer, window in enumerate(WINDOWS):
        extend(src.store, layer, src.store.plan(r2t, [1], [N], [N]), q[:N], k[:N], v[:N], window=window)
    return src, r2t, q, k, v


def _move(src, r2t_src, tails_and_sinks: bool):
    dst, r2t_dst = _side(22, 2)
    pages = -(-N // PAGE)  # every page item of the request, the open one included, as SGLang sends them
    for layer in range(LAYERS):
        for name in ("k_pages", "v_pages"):
            getattr(dst.store, name)[layer][22:22 + pages] = getattr(src.store, name)[layer][3:3 + pages]
    if tails_and_sinks:
        live = N % PAGE  # the DSA_TAIL component: only the live slots of the row
        for a, b in zip(tail_buffers(src), tail_buffers(dst)):
            b[2, :live] = a[1, :live]
        assert stage_sinks_for_send(src, r2t_src, 1)
        assert len(sink_buffers(src)) == 2  # every layer's K sinks in one buffer, V's in the other
        for a, b in zip(sink_buffers(src), sink_buffers(dst)):
            b[2] = a[1]  # the REQUEST_ROW component, row to row
    assert install_received_sinks(dst, r2t_dst, 2) >= 0
    return dst, r2t_dst


def _decode_both(source, dst, r2t_dst, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    src, r2t_src, q, k, v = source
    window = WINDOWS[layer]
    want = decode(src.store, layer, src.store.plan(r2t_src, [1], [N + 1], [1]), q[N:], k[N:], v[N:], window=window)
    got = decode(dst.store, layer, dst.store.plan(r2t_dst, [2], [N + 1], [1]), q[N:], k[N:], v[N:], window=window)
    return got, want


def test_decode_after_the_transfer_equals_decode_at_the_source(source):
    dst, r2t_dst = _move(source[0], source[1], tails_and_sinks=True)
    for layer in range(LAYERS):
        got, want = _decode_both(source, dst, r2t_dst, layer)
        assert torch.equal(got, want), (layer, (got.float() - want.float()).abs().max().item())


def test_without_the_tail_and_sinks_the_window_layer_answers_differently(source):
    """The check above can fail: without them the window layer reads zeros for 60 keys."""
    dst, r2t_dst = _move(source[0], source[1], tails_and_sinks=False)
    got, want = _decode_both(source, dst, r2t_dst, 0)
    assert not torch.equal(got, want)
