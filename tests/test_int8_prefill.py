"""PrefillMode.INT8 (`--hack-prefill int8`): the homomorphic prefill's kernel reading the chunk's
own pages from 6-bit codes (hack_ops/paged/chunk_codes.py) instead of the pool's 2-bit ones.

What holds: the tiled kernel (every build) equals the PyTorch path on the same codes within the
extend kernel's flip tolerance (tests/test_cpu_extend_kernel.py's argument: same codes, other
float order, an INT8 code of Q' or P' can flip on a rounding boundary); the output is several
times closer to exact attention than the homomorphic prefill's; the pool the store writes is the
homomorphic prefill's bit for bit, so decode is unchanged; a cached prefix's closed pages are
still read from the pool; layouts without per-channel K are refused with a sentence.
"""
from __future__ import annotations

import pytest
import torch

from hack_ops.attention import attention
from hack_ops.paged import cpu_extend, cpu_kernel
from hack_ops.paged.chunk_codes import LEVELS, quantize_chunks
from test_paged_attention import FLIP_TOL, ROUNDOFF_TOL, Case, make_cfg


@pytest.fixture(autouse=True)
def _need_kernel():
    for v in ("native", "portable"):
        if cpu_extend._lib(v) is None:
            pytest.skip(f"the CPU kernel could not be built here: {cpu_kernel._errors.get(v)}")


def _exact(case: Case, i: int) -> torch.Tensor:
    t = lambda x: x.transpose(0, 1)[None]  # noqa: E731  [L, H, D] -> [1, H, L, D]
    return attention(t(case.q[i]), t(case.k[i]), t(case.v[i]), case.cfg, mode="exact", **case.feat)[0].transpose(0, 1)


def _agree(a: dict, b: dict, what: str) -> None:
    for i in a:
        err = (a[i] - b[i]).abs().amax(-1)
        assert float(err.max()) <= FLIP_TOL, (what, i, float(err.max()))
        assert float((err <= ROUNDOFF_TOL).float().mean()) >= 0.9, (what, i)


def _both_paths(make, prefix: list[int], monkeypatch, variant: str = "tiled") -> tuple[dict, dict, dict]:
    """The prefix chunk, then the rest, by the compiled kernel and by PyTorch on fresh cases:
    (kernel outputs of the second chunk, PyTorch's, the kernel's first chunk)."""
    if variant == "portable":
        monkeypatch.setenv("HACK_EXTEND_KERNEL", "portable")
    outs = {}
    for backend in ("cpu", "torch"):
        case = make()
        assert backend == "torch" or cpu_extend.choose(case.store, "hack", prefill="int8")[0] in cpu_extend.TILED
        first = case.extend(prefix, prefill="int8", backend=backend)
        outs[backend] = (case.extend(case.lens, prefill="int8", backend=backend), first)
    _agree(outs["cpu"][1], outs["torch"][1], "first chunk")
    return outs["cpu"][0], outs["torch"][0], outs["cpu"][1]


@pytest.mark.parametrize("kw,feat", [
    (dict(sink_tokens=1), {}),
    (dict(sink_tokens=4, kv_bits=4), {}),
    (dict(range_search=True, k_bits=4), {}),
    (dict(sink_tokens=1), dict(window=40)),
    (dict(sink_tokens=0), dict(logit_cap=5.0)),
], ids=["plain", "4bit-sink4", "default-format-k4", "window", "softcap"])
def test_kernel_equals_reference(kw, feat, monkeypatch):
    """Cold prompts and chunks over unaligned and aligned cached prefixes, batched."""
    cfg = make_cfg(partition_size=32, **kw)
    lens, prefix = [150, 70, 96, 33], [45, 0, 64, 32]
    cpu, ref, _ = _both_paths(lambda: Case(cfg, lens=lens, heads=2, rep=3, seed=31, **feat), prefix, monkeypatch)
    _agree(cpu, ref, "second chunk")


def test_portable_build_agrees(monkeypatch):
    cfg = make_cfg(partition_size=32, sink_tokens=1)
    cpu, ref, _ = _both_paths(lambda: Case(cfg, lens=[130, 64], heads=1, rep=4, seed=32), [40, 0], monkeypatch,
                              variant="portable")
    _agree(cpu, ref, "portable")


def test_closer_to_exact_than_homomorphic():
    """A cold 256-token prompt: the INT8 prefill's error against exact attention is a small
    fraction of the homomorphic prefill's (same kernel, same Q/P rounding; only the chunk's
    codes differ)."""
    cfg = make_cfg(partition_size=32, sink_tokens=1)
    errs = {}
    for prefill in ("homomorphic", "int8"):
        case = Case(cfg, lens=[256], heads=2, rep=2, seed=33)
        out = case.extend([256], prefill=prefill, backend="cpu")[0]
        errs[prefill] = float((out - _exact(case, 0)).abs().mean())
    assert errs["int8"] < 0.25 * errs["homomorphic"], errs
    assert errs["int8"] < 0.02, errs


def test_pool_and_decode_unchanged():
    """The store writes the same 2-bit pages whichever prefill attends, so decode after an INT8
    prefill reads exactly what it reads after a homomorphic one."""
    cfg = make_cfg(partition_size=32, sink_tokens=1)
    stores, decoded = [], []
    for prefill in ("homomorphic", "int8"):
        case = Case(cfg, lens=[100, 70], heads=2, rep=2, seed=34)
        case.extend([90, 64], prefill=prefill, backend="cpu")
        decoded.append(case.decode(backend="cpu"))
        stores.append(case.store)
    a, b = stores
    assert all(torch.equal(x, y) for x, y in zip(a.k_pages + a.v_pages, b.k_pages + b.v_pages))
    assert all(torch.equal(decoded[0][i], decoded[1][i]) for i in decoded[0])


def test_prefix_pages_read_from_the_pool(monkeypatch):
    """Over a cached prefix, the prefix's closed pages are the pool's 2-bit pages: a one-token
    chunk after a 3-page prefix reads only those pages closed (its own page is open, FP16, in
    both modes), so the INT8 prefill's output is the homomorphic one bit for bit."""
    cfg = make_cfg(partition_size=32, sink_tokens=1)
    outs = {}
    for prefill in ("homomorphic", "int8"):
        case = Case(cfg, lens=[97], heads=2, rep=2, seed=35)
        case.extend([96], prefill="homomorphic", backend="cpu")
        outs[prefill] = case.extend([97], prefill=prefill, backend="cpu")[0]
    assert torch.equal(outs["homomorphic"], outs["int8"])


def test_codes_and_layout():
    """Codes stay within 6 bits (the signed operand of every build's dot products); sinks and
    tokens past the end take no part in a page's range; a layout with per-token K or without V's
    FP16 tail is refused (the window would lack the open page's V)."""
    g = torch.Generator().manual_seed(36)
    p, h, d = 32, 2, 64
    k = (torch.randn(80, h, d, generator=g) * 3).half()
    v = torch.randn(80, h, d, generator=g).half()
    k[0] = 1000  # a sink far outside the rest: must not widen page 0's range
    cc = quantize_chunks(k, v, torch.tensor([0]), [0], [80], p, 64, 1)
    assert cc.k_codes.shape == (3, h, p, d) and int(cc.k_codes.max()) <= LEVELS
    assert float(cc.k_scale[0].max()) < 1.0
    assert int(cc.k_codes[2, :, 16:].max()) == 0 and int(cc.v_codes[2, :, 16:].max()) == 0
    deq = cc.k_min[:, :, None, :] + cc.k_codes.float() * cc.k_scale[:, :, None, :]
    want = k.float().reshape(-1)[: 80 * h * d].reshape(80, h, d)
    got = deq.permute(0, 2, 1, 3).reshape(96, h, d)[:80]
    assert float((got[1:] - want[1:]).abs().max()) <= 0.5 * float(cc.k_scale.max()) + 1e-5
    for kw, named in ((dict(orientation="token_k"), "int8 reads K per channel"),
                      (dict(tail_tensors="per_channel"), "--hack-tail-tensors per_channel keeps V's as codes")):
        case = Case(make_cfg(partition_size=32, sink_tokens=1, **kw), lens=[40], heads=1, rep=1, seed=37)
        for backend in ("torch", "auto"):
            with pytest.raises(ValueError, match=named):
                case.extend([40], prefill="int8", backend=backend)


def test_per_query_fallback_is_not_taken(monkeypatch):
    """The per-query kernel reads a chunk as 2-bit codes: when the tiled kernel is off, INT8
    goes to PyTorch, which has the chunk codes."""
    monkeypatch.setenv("HACK_EXTEND_KERNEL", "per-query")
    case = Case(make_cfg(partition_size=32, sink_tokens=1), lens=[40], heads=1, rep=1, seed=38)
    path, why = cpu_extend.choose(case.store, "hack", prefill="int8")
    assert path == cpu_extend.ExtendPath.TORCH and "per-query" in why


@pytest.mark.parametrize("variant", ["native", "portable"])
def test_compiled_codes_equal_the_reference(variant):
    """cpu_extend.chunk_codes (C, beside the kernel) makes the reference's codes and side tables
    bit for bit: the same float operations in the same order."""
    g = torch.Generator().manual_seed(39)
    pre, seq = [0, 70, 128, 5, 640], [300, 301, 129, 64, 1000]
    wins = [(torch.randn(s - (p // 64) * 64, 3, 64, generator=g) * 3).half() for p, s in zip(pre, seq)]
    vins = [torch.randn(w.shape, generator=g).half() for w in wins]
    k, v = torch.cat(wins), torch.cat(vins)
    off = torch.tensor([0] + [w.numel() for w in wins[:-1]]).cumsum(0)
    args = (k, v, off, pre, seq, 64, 64, 4)
    want, got = quantize_chunks(*args), cpu_extend.chunk_codes(*args, variant=variant)
    for name in ("page0", "count", "k_codes", "k_scale", "k_min", "k_sums", "v_codes", "v_scale", "v_min"):
        assert torch.equal(getattr(want, name), getattr(got, name)), name


def test_a_gpu_server_refuses_int8_at_startup():
    """The chunk codes are the CPU kernel's: a GPU backend refuses the mode when it is built."""
    from types import SimpleNamespace

    from engine.gpu_attention import GpuAttention
    from hack_ops.modes import AttentionMode, PrefillMode

    with pytest.raises(NotImplementedError, match="--hack-prefill int8 runs on the CPU path only"):
        GpuAttention(None, SimpleNamespace(attention=AttentionMode.HACK), PrefillMode.INT8)
