"""Mixed extend batches: what chunked prefill and continuous batching hand the backend at once.

One batch holds a cold prompt (no cached prefix), a chunk over a page-aligned cached prefix, a
chunk over a prefix that ends mid-page, a prefix shorter than one page, a request at its first
decode step (one new token, as a mixed batch carries running requests) and a cold prompt
shorter than a page. Every (AttentionMode, PrefillMode, backend) combination must give each
request what it gets alone (the same per-request math, so equal bit for bit), that alone must
agree with the dense reference to the mode's tolerance, and decode after the batch must read
what the batch stored. The dense prefill once handed torch's CPU flash kernel a prefix of zero
keys for the cold request of such a batch, which dies with SIGFPE and takes the server down.
"""
from __future__ import annotations

import pytest
import torch

from hack_ops import attention
from hack_ops.paged import extend, extend_strawman
from test_paged_attention import FLIP_TOL, ROUNDOFF_TOL, Case, _exact_reference, _need_kernel, make_cfg

P = 32
# (final length, cached prefix before the mixed batch): the six shapes of the module docstring
REQUESTS = ((70, 0), (114, 64), (75, 45), (50, 9), (41, 40), (5, 0))
LENS = [n for n, _ in REQUESTS]
PREFIX = [pre for _, pre in REQUESTS]
CONFIGS = [
    dict(orientation="channel_k", sink_tokens=4, tail_tensors="kv"),  # the served default's shape
    dict(orientation="channel_k", sink_tokens=0, tail_tensors="kv", k_bits=4),
]
COMBOS = [(mode, prefill, backend)
          for mode in ("hack", "dequant") for prefill in ("homomorphic", "exact", "dense")
          for backend in ("torch", "cpu") if not (backend == "cpu" and mode == "dequant")]


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1)[None]


def _cached(cfg, seed: int = 3) -> Case:
    """A case whose requests hold their PREFIX tokens already (one cold prefill batch)."""
    case = Case(cfg, lens=LENS, seed=seed)
    case.extend(PREFIX)
    return case


def _reference(case: Case, i: int, prefill: str, mode: str) -> torch.Tensor:
    """Request i's new tokens as the dense reference computes them for this prefill."""
    pre, n = PREFIX[i], LENS[i]
    if prefill == "homomorphic":  # decode-time visibility, by the attention mode
        return (case.ref[i] if mode == case.mode else case._reference(i, mode))[pre:n]
    if pre == 0:  # every key is one of the chunk's own tokens, read at full precision
        return attention(_t(case.q[i]), _t(case.k[i]), _t(case.v[i]), case.cfg, mode="exact")[0].transpose(0, 1)
    return _exact_reference(case, i, pre)


def _check_reference(out: torch.Tensor, case: Case, i: int, prefill: str, mode: str) -> None:
    ref = _reference(case, i, prefill, mode)
    err = (out.float() - ref).abs()
    what = f"request {i} (length {LENS[i]}, prefix {PREFIX[i]}), {mode}/{prefill}"
    if prefill == "homomorphic":
        tol = ROUNDOFF_TOL if mode == "dequant" else FLIP_TOL
        assert float(err.max()) <= tol, f"{what}: max err {float(err.max()):.3g}"
    elif prefill == "dense" or mode == "dequant" or PREFIX[i] == 0:
        # dense attention over the prefix dequantized: the reference's own arithmetic
        assert float(err.max()) <= ROUNDOFF_TOL, f"{what}: max err {float(err.max()):.3g}"
    else:  # 'exact' under 'hack' reads the prefix's closed pages homomorphically (INT8 Q'/P')
        full = attention(_t(case.q[i]), _t(case.k[i]), _t(case.v[i]), case.cfg, mode="exact")[0].transpose(0, 1)
        gap = (full[PREFIX[i]:] - ref).abs()
        assert float(err.max()) < 0.3 and float(err.mean()) < 0.1 * float(gap.mean()) + ROUNDOFF_TOL, (
            what, float(err.mean()), float(gap.mean()))


@pytest.mark.parametrize("mode,prefill,backend", COMBOS, ids=lambda x: str(x))
@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: make_cfg(partition_size=P, **kw).label())
def test_mixed_batch_equals_each_request_alone(kw, mode, prefill, backend):
    if backend == "cpu":
        _need_kernel("native")
    cfg = make_cfg(partition_size=P, **kw)
    mixed = _cached(cfg)
    outs = mixed.extend(LENS, mode=mode, prefill=prefill, backend=backend)
    alone = _cached(cfg)
    for i, n in enumerate(LENS):
        upto = list(alone.done)
        upto[i] = n
        solo = alone.extend(upto, mode=mode, prefill=prefill, backend=backend)[i]
        # the same math; a cold request alone takes SDPA instead of the batch's per-request path
        assert float((outs[i] - solo).abs().max()) <= ROUNDOFF_TOL, (i, float((outs[i] - solo).abs().max()))
        _check_reference(outs[i], mixed, i, prefill, mode)
    # the batch stored what each request alone stores, so decode reads the same cache
    for name in ("k_pages", "v_pages"):
        assert torch.equal(getattr(mixed.store, name)[0], getattr(alone.store, name)[0]), name
    for name in mixed.store.tails:
        assert torch.equal(mixed.store.tails[name][0], alone.store.tails[name][0]), name


@pytest.mark.parametrize("prefill,backend", [("homomorphic", "cpu"), ("homomorphic", "torch"), ("exact", "cpu"),
                                             ("dense", "torch")])
def test_mixed_batch_with_a_window_and_a_soft_cap(prefill, backend):
    """A layer with a sliding window and a logit soft-cap (Gemma-3's) takes the masked paths:
    the mixed batch still gives each request what it gets alone."""
    if backend == "cpu":
        _need_kernel("native")
    cfg = make_cfg(partition_size=P, **CONFIGS[0])
    feats = dict(window=37, logit_cap=20.0, scale=0.11)
    mixed, alone = Case(cfg, lens=LENS, seed=3, **feats), Case(cfg, lens=LENS, seed=3, **feats)
    for case in (mixed, alone):
        case.extend(PREFIX)
    outs = mixed.extend(LENS, prefill=prefill, backend=backend)
    for i, n in enumerate(LENS):
        upto = list(alone.done)
        upto[i] = n
        solo = alone.extend(upto, prefill=prefill, backend=backend)[i]
        assert torch.isfinite(outs[i]).all()
        assert float((outs[i] - solo).abs().max()) <= ROUNDOFF_TOL, (i, float((outs[i] - solo).abs().max()))
        if prefill == "homomorphic":  # decode-time visibility: the reference with the same features
            assert float((outs[i] - mixed.ref[i][PREFIX[i]:n]).abs().max()) <= FLIP_TOL, i


@pytest.mark.parametrize("mode", ["hack", "dequant"])
def test_decode_after_a_mixed_batch(mode):
    """The batch's writes are what decode reads next: two decode steps over every request,
    checked against the reference at decode-time visibility."""
    cfg = make_cfg(partition_size=P, **CONFIGS[0])
    case = Case(cfg, lens=[n + 2 for n in LENS], seed=5, mode=mode)
    case.extend(PREFIX)
    case.extend(LENS, prefill="dense")
    for step in range(2):
        case.check(case.decode(), f"decode {step}")
    case.finish()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_prefill_of_a_mixed_batch_in_the_models_dtype(dtype):
    """What a BF16 server runs: extend_strawman (dense prefill and the strawman's) over the mixed
    batch in BF16, each request equal to itself alone, and within BF16 round-off of float32."""
    cfg = make_cfg(partition_size=P, **CONFIGS[0])
    outs = {}
    for batch in ("mixed", "alone"):
        case = _cached(cfg)
        plans = [list(range(len(LENS)))] if batch == "mixed" else [[i] for i in range(len(LENS))]
        got = {}
        for which in plans:
            plan = case.store.plan(case.table, [case.rows[i] for i in which], [LENS[i] for i in which],
                                   [LENS[i] - PREFIX[i] for i in which])
            cat = lambda xs: torch.cat([xs[i][PREFIX[i]:LENS[i]] for i in which]).to(dtype)  # noqa: E731
            o = extend_strawman(case.store, 0, plan, cat(case.q), cat(case.k), cat(case.v), dtype=dtype)
            assert o.dtype == dtype
            off = 0
            for i in which:
                got[i] = o[off:off + LENS[i] - PREFIX[i]]
                off += LENS[i] - PREFIX[i]
        outs[batch] = got
        ref_case = case
    for i in range(len(LENS)):
        assert torch.equal(outs["mixed"][i], outs["alone"][i]), i
        if dtype == torch.bfloat16:
            ref = _reference(ref_case, i, "dense", "hack")
            err = (outs["mixed"][i].float() - ref).abs()
            # BF16 inputs (K channels up to 7x), P and output; measured at most 6.6e-2, mean 5.4e-3
            assert float(err.max()) <= 0.1 and float(err.mean()) <= 1e-2, (i, float(err.max()), float(err.mean()))


def test_prefix_then_causal_with_an_empty_prefix_is_causal_attention():
    """No prefix keys: the chunk's causal attention, never a flash call over zero keys."""
    from hack_ops.paged.attention import prefix_then_causal

    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, 6, 9, 64, generator=g).to(dtype)
        kc, vc = (torch.randn(1, 2, 9, 64, generator=g).to(dtype) for _ in range(2))
        empty = torch.zeros(1, 2, 0, 64, dtype=dtype)
        out = prefix_then_causal(q, empty, empty, kc, vc, 0.125)
        want = torch.nn.functional.scaled_dot_product_attention(q, kc, vc, is_causal=True, scale=0.125,
                                                                enable_gqa=True).float()
        assert out.dtype == torch.float32 and torch.allclose(out, want, atol=2e-2 if dtype == torch.bfloat16 else 1e-6)


def test_lower_right_causal_with_an_empty_prefix():
    """The GPU dense path's bias form (run here on CPU tensors): with no prefix it is causal."""
    from hack_ops.paged.attention import lower_right_causal

    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 7, 64, generator=g)
    k, v = (torch.randn(1, 2, 7, 64, generator=g) for _ in range(2))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1, enable_gqa=True)
    assert torch.allclose(lower_right_causal(q, k, v, 0.1), want, atol=1e-6)


def test_cpu_flash_refuses_empty_ranges_with_a_sentence():
    """torch's CPU flash kernel divides by zero on an empty query or key range (SIGFPE, the
    process dies): the guard refuses such a call with a ValueError instead."""
    from hack_ops.paged.attention import cpu_flash

    q = torch.randn(1, 2, 4, 64)
    with pytest.raises(ValueError, match="no keys"):
        cpu_flash(q, q[:, :, :0], q[:, :, :0], causal=False, scale=0.125)
    with pytest.raises(ValueError, match="no queries"):
        cpu_flash(q[:, :, :0], q, q, causal=True, scale=0.125)
    with pytest.raises(ValueError, match="heads"):
        cpu_flash(q, q[:, :1], q[:, :1], causal=False, scale=0.125)
    o, lse = cpu_flash(q, q, q, causal=True, scale=0.125)
    assert o.shape == q.shape and lse.shape == q.shape[:3]


def test_compiled_kernels_refuse_an_empty_key_range():
    """The C kernels check what they are handed: a query with no key to attend (sequence length
    0) or a request with no new token after its prefix is refused with a Python error, never
    read out of bounds or left unwritten."""
    _need_kernel("native")
    from hack_ops.paged import cpu_extend, cpu_kernel

    cfg = make_cfg(partition_size=P, **CONFIGS[0])
    case = _cached(cfg)
    store, d = case.store, case.store.head_dim
    q = torch.randn(1, store.num_heads * 3, d)
    tail = store.tail("k", 0)
    zero = torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="no key"):
        cpu_kernel.attend(store, 0, q, 0.125, zero, zero, case.table[:1, ::P] // P, zero, zero, tail, zero,
                          store.tail("v", 0), zero)
    plan = store.plan(case.table, [case.rows[1]], [LENS[1]], [LENS[1] - PREFIX[1]])
    plan.prefix_lens = plan.seq_lens.clone()  # as if the request added nothing
    win = torch.zeros(P, store.num_heads, d, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="rejected"):
        cpu_extend.attend(store, 0, plan, q.expand(LENS[1] - PREFIX[1], -1, -1).contiguous(), 0.125, win, win,
                          torch.zeros(1, dtype=torch.long), exact=False)
