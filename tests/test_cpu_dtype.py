"""engine.cpu_dtype: float32 weights and a BF16 KV cache where the CPU has no BF16 arithmetic,
through SGLang's platform defaults; nothing changes elsewhere or where the user named a dtype."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine import cpu_dtype

AVX2 = {"avx2": True, "avx512_f": False, "avx512_bf16": False, "amx_bf16": False}
ZEN4 = {"avx2": True, "avx512_f": True, "avx512_bf16": True, "amx_bf16": False}
SPR = {"avx2": True, "avx512_f": True, "avx512_bf16": True, "amx_bf16": True}
SKX = {"avx2": True, "avx512_f": True, "avx512_bf16": False, "amx_bf16": False}


def _args(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"device": "cpu", "dtype": "auto", "kv_cache_dtype": "auto", **kw})


def test_bf16_arithmetic_by_cpu():
    assert not cpu_dtype.bf16_arithmetic(AVX2)
    assert cpu_dtype.bf16_arithmetic(ZEN4) and cpu_dtype.bf16_arithmetic(SPR)
    assert cpu_dtype.bf16_arithmetic(SKX)  # AVX-512 without BF16: not measured, left alone
    assert cpu_dtype.bf16_arithmetic({})  # torch cannot say: left alone


def test_avx2_host_runs_float32_weights_and_keeps_a_bf16_cache():
    a = _args()
    why = cpu_dtype.apply_defaults(a, AVX2)
    assert (a.dtype, a.kv_cache_dtype) == ("float32", "bfloat16")
    assert "no BF16 arithmetic" in why and "--dtype float32 --kv-cache-dtype bfloat16" in why


@pytest.mark.parametrize("kv", ["hack", "fp8_e4m3", "bfloat16"])
def test_a_named_kv_dtype_is_kept(kv):
    a = _args(kv_cache_dtype=kv)
    cpu_dtype.apply_defaults(a, AVX2)
    assert (a.dtype, a.kv_cache_dtype) == ("float32", kv)


@pytest.mark.parametrize("caps, args", [
    (ZEN4, _args()), (SPR, _args()), (SKX, _args()),  # BF16 (or unmeasured) hardware
    (AVX2, _args(dtype="bfloat16")),  # the user named the dtype
    (AVX2, _args(device="cuda")),
])
def test_nothing_changes_elsewhere(caps, args):
    before = dict(vars(args))
    assert cpu_dtype.apply_defaults(args, caps) is None
    assert vars(args) == before


def test_the_cpu_platform_applies_it():
    from engine.platform import HackCpuPlatform

    a = _args()
    HackCpuPlatform().apply_server_args_defaults(a)
    expected = ("auto", "auto") if cpu_dtype.bf16_arithmetic() else ("float32", "bfloat16")
    assert (a.dtype, a.kv_cache_dtype) == expected
