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


def _batch(embeds, positions=None, values=None):
    return SimpleNamespace(input_embeds=embeds, replace_positions=positions, replace_embeds=values)


def test_input_embeds_reach_a_float32_model_in_float32():
    """Upstream casts input_embeds to BF16 for every model; a float32 model died in its first
    linear. They are rebuilt from the request's float32 values, replacements included."""
    import torch

    src = torch.tensor([[0.1, 0.2], [0.3, 1.0 / 3.0], [0.5, 0.6]])
    upstream = {"input_embeds": src.bfloat16(), "other": 1}
    out = cpu_dtype.embeds_in_model_dtype(dict(upstream), _batch(src), torch.float32)
    assert out["input_embeds"].dtype == torch.float32 and torch.equal(out["input_embeds"], src)
    assert out["other"] == 1
    pos, vals = torch.tensor([1]), torch.tensor([[7.0, 8.0]])
    out = cpu_dtype.embeds_in_model_dtype(dict(upstream), _batch(src, pos, vals), torch.float32)
    assert out["input_embeds"][1].tolist() == [7.0, 8.0] and torch.equal(out["input_embeds"][0], src[0])
    assert torch.equal(src[1], torch.tensor([0.3, 1.0 / 3.0]))  # the batch's own tensor is not written
    # a BF16 model, or no input_embeds: upstream's kwargs as they were
    assert cpu_dtype.embeds_in_model_dtype(dict(upstream), _batch(src), torch.bfloat16)["input_embeds"].dtype == torch.bfloat16
    assert cpu_dtype.embeds_in_model_dtype({"other": 1}, _batch(None), torch.float32) == {"other": 1}
    # the model's own embeddings with replacements scattered in (no request embeds): cast
    own = {"input_embeds": torch.zeros(2, 2, dtype=torch.bfloat16)}
    assert cpu_dtype.embeds_in_model_dtype(own, _batch(None), torch.float32)["input_embeds"].dtype == torch.float32
