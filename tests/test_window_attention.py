"""Model features in the HACK attention paths, against the dense reference hack_ops.attention:
sliding windows (smaller than, equal to and not aligned with the partition size), head_dim 256
with one KV head (MQA) and GQA, the layer's scaling and logit soft-capping; the torch path,
the compiled CPU kernel (AVX-512 and plain-C builds) and the 'dequant' baseline.

Tolerances are test_paged_attention's: every row within FLIP_TOL (one INT8 code flip of
Q'/P'), 90% of rows within round-off; 'dequant' within round-off everywhere.
"""
from __future__ import annotations

import pytest
import torch

from hack_ops import attention
from hack_ops.paged import HackKVStore, decode
from hack_ops.paged.torch_attention import first_page
from test_paged_attention import FLIP_TOL, Case, _need_kernel, make_cfg

P = 32
# (window, what it exercises) with partition size 32
WINDOWS = [(13, "smaller than a page"), (31, "a page of keys (window+1 = 32)"), (32, "equal to the page"),
           (45, "not page-aligned"), (64, "two pages")]


def _run(case: Case, backend: str, ext1, ext2, steps: int = 3) -> None:
    extend_backend = "cpu" if backend == "cpu" else "torch"
    case.check(case.extend(ext1, backend=extend_backend), "extend 1")
    case.check(case.extend(ext2, backend=extend_backend), "extend 2")
    for step in range(steps):
        case.check(case.decode(backend=backend), f"decode {step}")
    case.finish()


@pytest.mark.parametrize("backend", ["torch", "cpu", "portable"])
@pytest.mark.parametrize("window", [w for w, _ in WINDOWS], ids=[why for _, why in WINDOWS])
def test_windows(window, backend):
    """Chunked prefill (the second chunk starts mid-page, past the window), then decode steps
    across a page boundary, for a mixed-length batch with sinks (which fall out of the window)."""
    if backend != "torch":
        _need_kernel("native" if backend == "cpu" else "portable")
    cfg = make_cfg(partition_size=P, sink_tokens=4)
    case = Case(cfg, lens=[140, 41, 100], seed=21, window=window)
    _run(case, backend, [20, 3, 45], [137, 38, 97])


@pytest.mark.parametrize("backend", ["torch", "cpu", "portable"])
@pytest.mark.parametrize("rep", [4, 3], ids=["mqa-1kv-4q", "gqa-2kv-6q"])
def test_head_dim_256_scaling_softcap(rep, backend):
    """Gemma-like layers: head_dim 256, one KV head (or GQA), a scale that is not 1/sqrt(d),
    soft-capped logits, a window, 4-bit and 2-bit codes."""
    if backend != "torch":
        _need_kernel("native" if backend == "cpu" else "portable")
    heads = 1 if rep == 4 else 2
    for bits, window in ((2, 40), (4, None)):
        cfg = make_cfg(partition_size=P, kv_bits=bits)
        case = Case(cfg, lens=[110, 70], heads=heads, rep=rep, head_dim=256, seed=22 + bits, window=window,
                    logit_cap=3.0, scale=0.11)
        _run(case, backend, [40, 33], [107, 67], steps=2)


@pytest.mark.parametrize("kw", [dict(orientation="token_k"), dict(requant_elimination=False),
                                dict(tail_tensors="per_channel", sink_tokens=4)],
                         ids=["token_k", "rqe-off", "tail-per_channel"])
def test_window_other_configs(kw):
    """The torch path's other layouts: per-token K, re-quantized open page, V without tail."""
    cfg = make_cfg(partition_size=P, **kw)
    case = Case(cfg, lens=[90, 50], seed=23, window=37, logit_cap=5.0)
    _run(case, "torch", [20, 9], [87, 47])


def test_dequant_baseline_window():
    cfg = make_cfg(partition_size=P)
    case = Case(cfg, lens=[100], seed=24, mode="dequant", window=45, logit_cap=4.0)
    _run(case, "torch", [40], [97])


def test_window_changes_the_output():
    """The window and the cap are not no-ops: without them the same cache gives other outputs."""
    cfg = make_cfg(partition_size=P)
    g = torch.Generator().manual_seed(25)
    q, k, v = (torch.randn(1, 2, 120, 64, generator=g) for _ in range(3))
    plain = attention(q, k, v, cfg, mode="hack")
    for kw in (dict(window=40), dict(logit_cap=1.0)):
        assert float((attention(q, k, v, cfg, mode="hack", **kw) - plain).abs().max()) > 10 * FLIP_TOL
    # exact mode: the window is SGLang's inclusive rule (window+1 keys), checked by hand
    w = 40
    ref = attention(q, k, v, cfg, mode="exact", window=w)[0, :, -1]
    s = (q[0, :, -1:] @ k[0, :, -w - 1:].transpose(-1, -2)) / 8.0
    assert torch.allclose(ref, (torch.softmax(s, -1) @ v[0, :, -w - 1:])[:, 0], atol=1e-5)


def test_pages_outside_the_window_are_not_read(monkeypatch):
    """Decode gathers only the pages from the window's first one: poison the earlier pages'
    codes and the output does not change."""
    cfg = make_cfg(partition_size=P, sink_tokens=1)
    case = Case(cfg, lens=[200], heads=1, rep=2, seed=26, window=50)
    case.extend([199])
    plan = case.store.plan(case.table, [case.rows[0]], [200])
    lo = first_page(199, 50, P)
    assert lo == 4
    q, k, v = case.q[0][199:200], case.k[0][199:200], case.v[0][199:200]
    store = case.store
    store.write(0, plan, k, v)
    before = decode(store, 0, plan, q, backend="torch", window=50)
    for pg in plan.page_table[0, :lo].tolist():
        store.k_pages[0][pg] = 255
        store.v_pages[0][pg] = 255
    after_torch = decode(store, 0, plan, q, backend="torch", window=50)
    assert torch.equal(before, after_torch)
    from hack_ops.paged import cpu_kernel
    if cpu_kernel.load("native") is not None:
        after_cpu = decode(store, 0, plan, q, backend="cpu", window=50)
        assert float((after_cpu - before).abs().max()) <= FLIP_TOL


def test_bad_features_are_rejected():
    cfg = make_cfg(partition_size=P)
    store = HackKVStore(cfg, 1, 1, 64, num_pages=4, num_rows=2)
    plan = store.plan(torch.arange(64, dtype=torch.int32).reshape(2, 32), [0], [1])
    q = torch.zeros(1, 1, 64)
    with pytest.raises(ValueError, match="window"):
        decode(store, 0, plan, q, window=-5)
    with pytest.raises(ValueError, match="logit_cap"):
        decode(store, 0, plan, q, logit_cap=float("nan"))
    x = torch.zeros(1, 1, 4, 64)
    with pytest.raises(ValueError, match="window"):
        attention(x, x, x, window=2.5)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_exact_prefill_window(backend):
    """'exact' prefill (the server default): a cold prompt is dense float attention with the
    window and cap (query blocks over the keys their window reaches), then a chunk over a cached
    prefix; both against the reference within the usual tolerances."""
    if backend == "cpu":
        _need_kernel("native")
    from hack_ops.paged.attention import masked_dense

    cfg = make_cfg(partition_size=P)
    case = Case(cfg, lens=[150, 60], seed=27, window=45, logit_cap=4.0, scale=0.2)
    outs = case.extend([150, 60], prefill="exact", backend=backend)
    t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    for i in range(2):
        ref = attention(t(case.q[i]), t(case.k[i]), t(case.v[i]), cfg, mode="exact", window=45, logit_cap=4.0,
                        scale=0.2)[0].transpose(0, 1)
        assert float((outs[i] - ref).abs().max()) <= 5e-5
        small = masked_dense(t(case.q[i]), t(case.k[i]), t(case.v[i]), 0.2, 45, 4.0,
                              torch.arange(case.lens[i]), block=16)[0].transpose(0, 1)
        assert float((small - ref).abs().max()) <= 5e-5
    # a chunk after a cached prefix: quantized prefix pages inside the window, FP16 new tokens
    case = Case(cfg, lens=[150], seed=28, window=45)
    case.extend([100])
    out = case.extend([150], prefill="exact", backend=backend)[0]
    ref = attention(t(case.q[0]), t(case.k[0]), t(case.v[0]), cfg, mode="exact", window=45)[0].transpose(0, 1)[100:]
    # new tokens at t >= 145 see only FP16 new keys (their windows start after the prefix), so
    # they equal exact attention; earlier ones also read 2-bit prefix pages (test_windows)
    assert float((out[45:] - ref[45:]).abs().max()) <= 5e-5
    assert float((out[:40] - ref[:40]).abs().mean()) > 1e-3  # t <= 140: 2-bit prefix pages were read


@pytest.mark.parametrize("cap", [0.0, 4.0], ids=["sdpa-bf16", "float32-softcap"])
def test_masked_dense_bf16_window_gqa(cap):
    """masked_dense on BF16 inputs (a BF16 model's window layers): without a soft-cap it runs
    SDPA in BF16 with each query block's window mask, GQA unrepeated; with one it attends in
    float32. Queries at positions after a prefix, blocks smaller than the window, against the
    reference's exact attention on the same BF16 values (measured: 4.3e-3 SDPA, 2.7e-7 float32)."""
    from hack_ops.paged.attention import masked_dense

    g = torch.Generator().manual_seed(33)
    m, n, h, rep, d, window = 200, 90, 1, 4, 256, 45
    q = torch.randn(1, h * rep, n, d, generator=g).bfloat16()
    k, v = (torch.randn(1, h, m, d, generator=g).bfloat16() for _ in range(2))
    out = masked_dense(q, k, v, 0.0625, window, cap, torch.arange(m - n, m), block=32)
    assert out.dtype == torch.float32 and out.shape == q.shape
    ref = attention(q.float(), k.float(), v.float(), window=window, logit_cap=cap, scale=0.0625)
    err = float((out - ref).abs().max())
    assert err <= (1e-2 if not cap else 1e-5), err
