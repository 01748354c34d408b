"""The tiled extend (prefill) kernel, hack_ops/paged/csrc/hack_extend.c, against the dense
reference hack_ops.attention (mode 'hack', decode-time visibility) and the other extend paths.

Tolerances are test_paged_attention's (FLIP_TOL per row, 90% of rows within ROUNDOFF_TOL), for
the same reasons: the kernel does the reference's arithmetic in another order and quantizes Q'
and P' to INT8, so a value sitting on a rounding boundary can flip one INT8 code and move one
row by up to ~1e-2; everything else agrees to float round-off. Two of the kernel's choices
make such flips a little more likely, and stay inside that argument: codes are computed as
(x - min) * (1/s) rather than (x - min) / s (differs by an ulp before rounding), and P' is
quantized against the running softmax max instead of the row's final max (min/max INT8
quantization is scale invariant up to float rounding). For scale, 2-bit quantization moves
outputs by ~0.1-0.5 (test_paged_attention.test_tolerance_is_meaningful).

Shapes and tail lengths follow the Triton prefill tests: a fresh multi-page prompt, an aligned
prefix, unaligned prefixes whose open page closes and more pages follow, an extend inside one
page, one token closing a page, a short sequence; every open-partition length; Π 32/64/128;
head_dim 64/128/256; GQA 1..16; kv_bits 2/4; sinks 0/1/4; V with or without an FP16 tail.
"""
from __future__ import annotations

import pytest
import torch

from hack_ops.paged import cpu_extend, cpu_kernel
from hack_ops.paged.attention import _fp16_windows
from test_paged_attention import FLIP_TOL, ROUNDOFF_TOL, Case, make_cfg


@pytest.fixture(autouse=True)
def _need_kernel():
    for v in ("native", "portable"):
        if cpu_extend._lib(v) is None:
            pytest.skip(f"the CPU kernel could not be built here: {cpu_kernel._errors.get(v)}")


def _mixed(p: int) -> tuple[list[int], list[int]]:
    return [0, p, p + 5, 2 * p + 3, 3 * p - 1, 1], [p + 6, 7, 2 * p, 4, 1, 3]


def _run_mixed(cfg, head_dim: int, rep: int, seed: int, heads: int = 2) -> Case:
    p = cfg.partition_size
    prefix, new = _mixed(p)
    case = Case(cfg, lens=[a + b for a, b in zip(prefix, new)], heads=heads, rep=rep, head_dim=head_dim, seed=seed)
    assert cpu_extend.choose(case.store, "hack")[0] in cpu_extend.TILED
    case.check(case.extend(prefix, backend="cpu"), "prefix chunk")
    case.check(case.extend([a + b for a, b in zip(prefix, new)], backend="cpu"), "second chunk")
    case.finish()
    return case


@pytest.mark.parametrize("p,head_dim,rep,bits,sinks", [
    (32, 64, 3, 2, 2),
    (64, 64, 1, 2, 1),
    (64, 128, 4, 4, 0),
    (128, 128, 4, 2, 4),
    (64, 256, 3, 2, 1),
    (32, 128, 16, 4, 1),
])
def test_mixed_batch(p, head_dim, rep, bits, sinks):
    """Chunked prefill over cached prefixes (aligned or not) for a batch mixing requests."""
    _run_mixed(make_cfg(partition_size=p, kv_bits=bits, sink_tokens=sinks), head_dim, rep, seed=p + head_dim + rep)


@pytest.mark.parametrize("kw", [
    dict(tail_tensors="per_channel", sink_tokens=0),  # V read from its per-token codes when open
    dict(tail_tensors="per_channel", sink_tokens=4, kv_bits=4),
    dict(meta_dtype="float32", sink_tokens=5, kv_bits=4),
    dict(range_search=True),  # the default format
    dict(k_bits=4, sink_tokens=1),
    dict(kv_bits=4, k_bits=2, tail_tensors="per_channel", sink_tokens=2),
], ids=["v-codes-open", "v-codes-open-4bit-sink4", "meta-fp32", "default-format", "k4-v2", "k2-v4-v-codes-open"])
def test_format_options(kw):
    _run_mixed(make_cfg(partition_size=32, **kw), 64, 2, seed=21)


@pytest.mark.parametrize("variant", ["tiled", "portable"])
def test_every_tail_length(variant, monkeypatch):
    """Prefixes ending at every offset 0..Π-1 of a page, then a chunk crossing pages: the
    plain-C build (chosen at run time by HACK_EXTEND_KERNEL=portable) too."""
    if variant == "portable":
        monkeypatch.setenv("HACK_EXTEND_KERNEL", "portable")
    p = 32
    cfg = make_cfg(partition_size=p, sink_tokens=1)
    prefix = [p + i for i in range(p)]
    case = Case(cfg, lens=[n + 37 for n in prefix], heads=1, rep=2, seed=22)
    want = cpu_extend.ExtendPath.PORTABLE if variant == "portable" else cpu_extend.tiled_path()
    assert cpu_extend.choose(case.store, "hack")[0] == want
    case.check(case.extend(prefix, backend="cpu"), "prefix")
    case.check(case.extend([n + 37 for n in prefix], backend="cpu"), "chunk")
    case.finish()


def _direct(case: Case, **kw) -> torch.Tensor:
    """The kernel called directly on a cold batch already written to the store."""
    plan = case.store.plan(case.table, case.rows, case.lens, case.lens)
    k, v = torch.cat(case.k), torch.cat(case.v)
    kw_, vw, woff = _fp16_windows(case.store, plan, k, v, {})
    q = torch.cat(case.q)
    return cpu_extend.attend(case.store, 0, plan, q, case.store.head_dim ** -0.5, kw_, vw, woff, False, **kw)


def test_blocks_threads_and_builds_agree():
    """Each query row is computed by one thread from the same operands in the same order, so
    the work split (block size, thread count) changes no bit; the plain-C build matches the
    VNNI build to the flip tolerance (same codes, other float order), and the AVX2 build bit for
    bit (the plain-C operations in the same order, 8 lanes a register)."""
    cfg = make_cfg(partition_size=32, sink_tokens=2)
    case = Case(cfg, lens=[150, 61], heads=2, rep=3, seed=23)
    plan = case.store.plan(case.table, case.rows, case.lens, case.lens)
    case.store.write(0, plan, torch.cat(case.k), torch.cat(case.v))
    base = _direct(case)
    assert torch.equal(base, _direct(case, block_tokens=1))
    assert torch.equal(base, _direct(case, block_tokens=7))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(base, _direct(case))
    finally:
        torch.set_num_threads(threads)
    plain = _direct(case, variant="portable")
    err = (base - plain).abs().amax(-1)
    assert float(err.max()) <= FLIP_TOL and float((err <= 5e-5).float().mean()) >= 0.9
    if cpu_extend.tiled_path() == cpu_extend.ExtendPath.AVX2:
        assert torch.equal(base, plain)
    ref = torch.cat(case.ref)
    assert float((base - ref).abs().amax(-1).max()) <= FLIP_TOL


def assert_extend_paths_agree(new_case, prefix_lens: list[int], prefill: str, monkeypatch) -> None:
    """Tiled, per-query and torch extend over a cached prefix of `prefix_lens` tokens (each path
    on its own fresh `new_case()`) agree within FLIP_TOL per row and round-off for 90% of rows;
    with 'homomorphic' prefill each also matches the dense reference ('exact' has none over a
    prefix)."""
    outs = {}
    for path in ("tiled", "per-query", "torch"):
        if path == "per-query":
            monkeypatch.setenv("HACK_EXTEND_KERNEL", "per-query")
        else:
            monkeypatch.delenv("HACK_EXTEND_KERNEL", raising=False)
        case = new_case()
        case.extend(prefix_lens, backend="torch")
        outs[path] = case.extend(case.lens, prefill=prefill, backend="torch" if path == "torch" else "cpu")
        if prefill == "homomorphic":
            case.check(outs[path], path)
    for i in range(len(prefix_lens)):
        for path in ("per-query", "torch"):
            err = (outs["tiled"][i] - outs[path][i]).abs().amax(-1)
            assert float(err.max()) <= FLIP_TOL, (path, i, float(err.max()))
            assert float((err <= ROUNDOFF_TOL).float().mean()) >= 0.9, (path, i)


@pytest.mark.parametrize("prefill", ["homomorphic", "exact"])
def test_paths_agree(prefill, monkeypatch):
    """Tiled, per-query and torch extend over a cached unaligned prefix read the same cache."""
    cfg = make_cfg(partition_size=32, sink_tokens=1)
    assert_extend_paths_agree(lambda: Case(cfg, lens=[140, 50], seed=24), [45, 20], prefill, monkeypatch)


def test_path_choice_and_reasons(monkeypatch):
    cfg = make_cfg(partition_size=32)
    case = Case(cfg, lens=[40], seed=25)
    path, why = cpu_extend.choose(case.store, "hack")
    assert path == cpu_extend.tiled_path()
    assert why.endswith(cpu_extend.amx_note()) and "AMX" in cpu_extend.describe(case.store, "hack")
    assert cpu_extend.choose(case.store, "dequant")[0] == cpu_extend.ExtendPath.TORCH
    assert cpu_extend.choose(case.store, "hack", backend="torch")[0] == cpu_extend.ExtendPath.TORCH
    # A sliding window or soft-cap stays on the tiled kernel (tests/test_cpu_extend_window.py).
    for kw in ({"window": 16}, {"logit_cap": 30.0}):
        assert cpu_extend.choose(case.store, "hack", **kw)[0] == path
    monkeypatch.setenv("HACK_EXTEND_KERNEL", "per-query")
    path, why = cpu_extend.choose(case.store, "hack")
    assert path == cpu_extend.ExtendPath.PER_QUERY and "per-query" in why
    monkeypatch.delenv("HACK_EXTEND_KERNEL")
    tk = Case(make_cfg(partition_size=32, orientation="token_k"), lens=[40], seed=25)
    path, why = cpu_extend.choose(tk.store, "hack")
    assert path == cpu_extend.ExtendPath.TORCH and "token_k" in why
    with pytest.raises(RuntimeError, match="not usable"):
        tk.extend([40], backend="cpu")
    with pytest.raises(ValueError, match="backend"):
        cpu_extend.choose(case.store, "hack", backend="gpu")


def test_amx_note_names_what_the_cpu_has():
    """The path description says AMX-INT8 is unused and whether the CPU has it, from its flags."""
    with_amx = "processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni amx_bf16 amx_tile amx_int8\n"
    without = "processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni\n"
    assert cpu_extend.cpu_has_amx_int8(with_amx) and not cpu_extend.cpu_has_amx_int8(without)
    assert "has it" in cpu_extend.amx_note(with_amx) and "has none" in cpu_extend.amx_note(without)
    assert not cpu_extend.cpu_has_amx_int8("flags\t\t: amx_int8x\n")  # whole flags only
    case = Case(make_cfg(partition_size=32), lens=[40], seed=25)
    assert cpu_extend.choose(case.store, "hack")[1].endswith(cpu_extend.amx_note())  # this CPU's flags
