"""Triton store kernel on the kernel device (tests/conftest.py: a CUDA GPU when present, else
TRITON_INTERPRET=1 on CPU tensors): byte-identical pages, tails and sinks to the CPU path's store
(hack_ops.paged.HackKVStore, on the CPU) and to pages built directly with hack_ops.quantize,
over prefill chunks, multi-page extends and decode steps; K and V with the same bits or with
their own (HackConfig.k_bits: 4-bit K with 2-bit V, and the reverse)."""
from __future__ import annotations

import pytest
import torch

from hack_ops import HackConfig
from hack_ops.layout import page_layout
from hack_ops.paged import HackKVStore
from hack_ops.paged.fill import scattered_table
from hack_ops.triton.batch import batch_from_plan, plan_batch
from hack_ops.triton.spec import kernel_spec
from hack_ops.triton.store import cache_kwargs, new_buffers, store
from hack_ops.triton.testing import fill_sequence, require_kernel_device, to_device

H = 2


@pytest.fixture(autouse=True, scope="module")
def _kernel_device(kernel_device):
    require_kernel_device(kernel_device)


def _kv(n: int, d: int, seed: int, dtype=torch.float16, heads: int = H):
    g = torch.Generator().manual_seed(seed)
    chan = (1 + torch.arange(d) % 5).float()  # uneven channel ranges, like real K
    return (torch.randn(n, heads, d, generator=g) * chan).to(dtype), torch.randn(n, heads, d, generator=g).to(dtype)


def _compare_with_cpu_store(device, cfg: HackConfig, d: int, schedule: list[list[int]], seed: int = 0,
                            heads: int = H):
    """Write the same tokens step by step with the CPU store and the Triton store on `device`
    (each step adds schedule[step][i] tokens to request i, 0 = idle) and compare every byte."""
    p = cfg.partition_size
    rows = [3, 1]
    totals = [sum(s[i] for s in schedule) for i in range(len(rows))]
    ref = HackKVStore(cfg, 1, heads, d, num_pages=sum(-(-n // p) for n in totals) + 4, num_rows=4)
    table = scattered_table(totals, p, 4, rows, ref.num_pages, generator=torch.Generator().manual_seed(seed))
    mine = to_device({"k_buf": ref.k_pages[0].clone(), "v_buf": ref.v_pages[0].clone(),
                      "tail_k": ref.tail("k", 0).clone(),
                      "tail_v": None if ref.tail("v", 0) is None else ref.tail("v", 0).clone(),
                      "sink_k": ref.sink_k[0].clone(), "sink_v": ref.sink_v[0].clone()}, device)
    kv = [_kv(n, d, seed + i, heads=heads) for i, n in enumerate(totals)]
    done = [0] * len(rows)
    for step in schedule:
        act = [i for i, n in enumerate(step) if n]
        lens = [done[i] + step[i] for i in act]
        plan = ref.plan(table, [rows[i] for i in act], lens, [step[i] for i in act])
        k = torch.cat([kv[i][0][done[i]:done[i] + step[i]] for i in act])
        v = torch.cat([kv[i][1][done[i]:done[i] + step[i]] for i in act])
        ref.write(0, plan, k, v)
        store(ref.layout, batch_from_plan(plan, device), k.to(device), v.to(device), **mine)
        for i in act:
            done[i] += step[i]
    mine = to_device(mine, torch.device("cpu"))
    assert torch.equal(mine["k_buf"], ref.k_pages[0]), "K pages differ"
    assert torch.equal(mine["v_buf"], ref.v_pages[0]), "V pages differ"
    assert torch.equal(mine["sink_k"], ref.sink_k[0]) and torch.equal(mine["sink_v"], ref.sink_v[0])
    for name in ("k", "v"):
        if ref.tail(name, 0) is None:
            continue
        for row, n in zip(rows, totals):  # live slots of the open page (the rest is unspecified)
            assert torch.equal(mine["tail_" + name][row, : n % p], ref.tail(name, 0)[row, : n % p])


@pytest.mark.parametrize("page,d,kw", [
    (32, 64, {}),
    (64, 128, {"sink_tokens": 4, "range_search": False}),
    (32, 64, {"tail_tensors": "per_channel", "sink_tokens": 2}),
    (32, 64, {"kv_bits": 4, "meta_dtype": "float32", "sink_tokens": 0}),
    (32, 64, {"k_bits": 4, "sink_tokens": 2}),  # K 4-bit, V 2-bit
    (32, 64, {"kv_bits": 4, "k_bits": 2, "tail_tensors": "per_channel"}),  # K 2-bit, V 4-bit written at once
    pytest.param(128, 256, {"sink_tokens": 3}, marks=pytest.mark.slow),
])
def test_byte_identical_to_cpu_store(kernel_device, page, d, kw):
    cfg = HackConfig(partition_size=page, **kw)
    p = page
    schedule = [[p + 5, 3], [1, 1], [2 * p, p - 4], [1, 1], [1, 2], [0, 1]]  # chunks, decode, page-closing steps
    _compare_with_cpu_store(kernel_device, cfg, d, schedule)


@pytest.mark.parametrize("bits", [{}, {"k_bits": 4}, {"kv_bits": 4, "k_bits": 2}], ids=["K2V2", "K4V2", "K2V4"])
def test_byte_identical_to_direct_quantization(kernel_device, bits):
    """Pages after incremental stores equal pages quantized in one go from the whole sequence
    (K's codes with K's bits, V's with V's)."""
    cfg = HackConfig(partition_size=32, sink_tokens=3, **bits)
    lay = page_layout(cfg, H, 128)
    lens = [70, 33]
    kv = [_kv(n, 128, 5 + i) for i, n in enumerate(lens)]
    pages = [[7, 2, 4], [0, 6]]
    dev = kernel_device
    mine, ref = new_buffers(lay, 9, 3, 9, device=dev), new_buffers(lay, 9, 3, 9)
    indptr = torch.tensor([0, 3, 5], device=dev)
    indices = torch.tensor([x for pg in pages for x in pg], device=dev)
    done = [0, 0]
    for step in ([40, 31], [1, 1], [29, 1]):
        new_lens = [d + s for d, s in zip(done, step)]
        qo = torch.tensor([0, step[0], step[0] + step[1]], device=dev)
        b = plan_batch(indptr, indices, torch.tensor(new_lens, device=dev), 32, qo_indptr=qo,
                       tail_rows=torch.tensor([2, 0], device=dev), sink_slots=torch.tensor([7, 0], device=dev))
        k = torch.cat([kv[i][0][done[i]:new_lens[i]] for i in range(2)])
        v = torch.cat([kv[i][1][done[i]:new_lens[i]] for i in range(2)])
        store(lay, b, k.to(dev), v.to(dev), **cache_kwargs(mine))
        done = new_lens
    mine = to_device(mine, torch.device("cpu"))
    for i, (row, slot) in enumerate(((2, 7), (0, 0))):
        fill_sequence(lay, ref, kv[i][0].float(), kv[i][1].float(), pages[i], row, slot)
    for name in ("k_buf", "v_buf", "sink_k", "sink_v"):
        assert torch.equal(mine[name], ref[name]), name
    for row, n in ((2, 70), (0, 33)):
        assert torch.equal(mine["tail_k"][row, : n % 32], ref["tail_k"][row, : n % 32])
        assert torch.equal(mine["tail_v"][row, : n % 32], ref["tail_v"][row, : n % 32])


def test_kernel_spec_takes_each_tensors_bits():
    """The kernels' constants carry K's and V's bits apart, also for a layer raised by
    four_bit_layers with raised_tensors='k'."""
    for cfg, want in ((HackConfig(), (2, 2)), (HackConfig(kv_bits=4), (4, 4)), (HackConfig(k_bits=4), (4, 2)),
                      (HackConfig(kv_bits=4, k_bits=2), (2, 4)),
                      (HackConfig(four_bit_layers=(1,), raised_tensors="k").for_layer(1, 3), (4, 2))):
        spec = kernel_spec(page_layout(cfg, H, 64))
        assert (spec.k_bits, spec.v_bits) == want, cfg.label()


def test_pages_then_tail_equals_all(kernel_device):
    cfg = HackConfig(partition_size=32, range_search=False)
    lay = page_layout(cfg, H, 64)
    dev = kernel_device
    k, v = to_device(list(_kv(80, 64, 3)), dev)
    b = plan_batch(torch.tensor([0, 3], device=dev), torch.tensor([4, 1, 2], device=dev), torch.tensor([80], device=dev),
                   32, qo_indptr=torch.tensor([0, 80], device=dev))
    one, two = new_buffers(lay, 5, 1, 5, device=dev), new_buffers(lay, 5, 1, 5, device=dev)
    store(lay, b, k, v, **cache_kwargs(one))
    store(lay, b, k, v, **cache_kwargs(two), phase="pages")
    assert torch.equal(two["tail_k"], torch.zeros_like(two["tail_k"]))  # the pages phase leaves tails alone
    store(lay, b, k, v, **cache_kwargs(two), phase="tail")
    for name in one:
        assert torch.equal(one[name], two[name]), name


def test_bad_input_is_refused(kernel_device):
    lay = page_layout(HackConfig(partition_size=32), H, 64)
    dev = kernel_device
    bufs = new_buffers(lay, 4, 1, 4, device=dev)
    b = plan_batch(torch.tensor([0, 2], device=dev), torch.tensor([0, 1], device=dev), torch.tensor([40], device=dev), 32,
                   qo_indptr=torch.tensor([0, 40], device=dev))
    k, v = to_device(list(_kv(40, 64, 0)), dev)
    with pytest.raises(ValueError, match="phase"):
        store(lay, b, k, v, **cache_kwargs(bufs), phase="later")
    with pytest.raises(ValueError, match="k must be"):
        store(lay, b, k[:39], v, **cache_kwargs(bufs))
    with pytest.raises(ValueError, match="k must be"):
        store(lay, b, k.to(torch.int16), v, **cache_kwargs(bufs))
    bad = cache_kwargs(bufs)
    bad["tail_k"] = bad["tail_k"].float()
    with pytest.raises(ValueError, match="tail_k"):
        store(lay, b, k, v, **bad)
    with pytest.raises(ValueError, match="qo_indptr"):
        plan_batch(torch.tensor([0, 2]), torch.tensor([0, 1]), torch.tensor([40]), 32, qo_indptr=torch.tensor([0]))
    with pytest.raises(ValueError, match="at most seq_len"):
        plan_batch(torch.tensor([0, 2]), torch.tensor([0, 1]), torch.tensor([40]), 32, qo_indptr=torch.tensor([0, 41]))
    assert torch.equal(bufs["k_buf"], torch.zeros_like(bufs["k_buf"]))  # nothing was written


@pytest.mark.cuda
def test_real_shapes_byte_identical(kernel_device):
    """Llama-3-8B-like KV (8 heads, head_dim 128), the serving default format, contexts to 10K:
    two long prefill chunks per request, decode steps, a chunk that closes an open page."""
    schedule = [[8192, 4096], [1, 1], [2048 + 5, 61], [1, 1], [1, 2]]
    _compare_with_cpu_store(kernel_device, HackConfig(), 128, schedule, heads=8)
