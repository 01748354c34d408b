"""`--hack-prefill auto` (engine.prefill_choice): the server's default prefill, chosen at startup
from the device, the model's dtype and the CPU's AMX-BF16; the kernels never see 'auto'."""
from __future__ import annotations

import pytest
import torch

from engine import settings as settings_mod
from engine.args import HackArgumentError, settings_from_options
from engine.prefill_choice import choose_prefill, cpu_has_amx_bf16, dense_dtype
from hack_ops import AttentionMode, HackConfig, PrefillMode
from hack_ops.paged import extend
from hack_ops.paged.cpu_extend import simd as extend_simd
from hack_ops.paged.store import HackKVStore

SPR_FLAGS = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
EPYC_FLAGS = "processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni avx512_bf16\n"


def test_amx_bf16_from_torch_capabilities_or_cpuinfo():
    assert cpu_has_amx_bf16(capabilities={"amx_bf16": True, "amx_int8": True})
    assert not cpu_has_amx_bf16(capabilities={"amx_bf16": False, "avx512_bf16": True})
    assert not cpu_has_amx_bf16(capabilities={})
    assert cpu_has_amx_bf16(cpuinfo=SPR_FLAGS)
    assert not cpu_has_amx_bf16(cpuinfo=EPYC_FLAGS)
    assert not cpu_has_amx_bf16(cpuinfo="flags : fpu amx_bf16x\n")  # whole flags only
    # this host: torch's view and the kernel's flags agree
    if hasattr(torch.cpu, "get_capabilities"):
        with open("/proc/cpuinfo") as f:
            assert cpu_has_amx_bf16() == cpu_has_amx_bf16(cpuinfo=f.read())


@pytest.mark.parametrize("device, dtype, amx, expected, why", [
    ("cpu", torch.bfloat16, True, PrefillMode.DENSE, "has AMX-BF16 and the model runs in BF16"),
    ("cpu", torch.bfloat16, False, PrefillMode.INT8, "no AMX-BF16"),
    ("cpu", torch.float32, True, PrefillMode.INT8, "runs in float32"),
    ("cpu", torch.float16, True, PrefillMode.INT8, "runs in float16"),
    ("cuda", torch.bfloat16, True, PrefillMode.DENSE, "the Triton store, then dense attention"),
])
def test_auto_resolves_by_host_and_dtype(device, dtype, amx, expected, why):
    mode, reason = choose_prefill(PrefillMode.AUTO, AttentionMode.HACK, device, dtype, has_amx_bf16=amx,
                                  has_int8_simd=True)
    assert mode == expected and why in reason and "--hack-prefill auto" in reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_auto_is_dense_where_the_int8_kernel_has_no_simd(dtype):
    """An AVX2-only CPU: the INT8 kernel is plain C loops there, so auto is dense for any dtype
    and AMX answer; the answer for this host follows the kernel's own build."""
    for amx in (True, False):
        mode, reason = choose_prefill(PrefillMode.AUTO, AttentionMode.HACK, "cpu", dtype, has_amx_bf16=amx,
                                      has_int8_simd=False)
        assert mode == PrefillMode.DENSE and "no AVX-512 VNNI path" in reason
    here, _ = choose_prefill(PrefillMode.AUTO, AttentionMode.HACK, "cpu", torch.float32, has_amx_bf16=False)
    assert here == (PrefillMode.INT8 if extend_simd() else PrefillMode.DENSE)


def test_auto_takes_the_homomorphic_kernel_where_int8_cannot_read_the_layout():
    """PrefillMode.INT8's chunk codes are the default layout's (per-channel K, FP16 tails of K and
    V): a server with another layout gets the homomorphic prefill from auto, and says why."""
    from hack_ops.paged.chunk_codes import layout_refusal

    assert layout_refusal(HackConfig()) is None
    for cfg, named in ((HackConfig(orientation="token_k"), "--hack-orientation token_k"),
                       (HackConfig(tail_tensors="per_channel"), "--hack-tail-tensors per_channel")):
        mode, reason = choose_prefill(PrefillMode.AUTO, AttentionMode.HACK, "cpu", torch.bfloat16, has_amx_bf16=False,
                                      has_int8_simd=True, int8_refusal=layout_refusal(cfg))
        assert mode == PrefillMode.HOMOMORPHIC and named in reason, reason


@pytest.mark.parametrize("asked", [PrefillMode.HOMOMORPHIC, PrefillMode.INT8, PrefillMode.EXACT, PrefillMode.DENSE])
def test_an_explicit_mode_is_kept_on_every_host(asked):
    for device, amx in (("cpu", True), ("cpu", False), ("cuda", False)):
        mode, reason = choose_prefill(asked.value, AttentionMode.HACK, device, torch.bfloat16, has_amx_bf16=amx,
                                      has_int8_simd=amx)
        assert mode == asked and reason == f"--hack-prefill {asked.value}"


def test_the_strawman_prefills_its_own_way():
    for asked in PrefillMode:
        mode, reason = choose_prefill(asked, AttentionMode.DEQUANT, "cpu", torch.bfloat16, has_amx_bf16=True)
        assert mode == PrefillMode.HOMOMORPHIC and "dequant" in reason


def test_auto_is_the_default_and_a_flag_value():
    assert settings_mod.EngineSettings().prefill == PrefillMode.AUTO
    assert HackConfig() == settings_mod.EngineSettings().config
    ns = type("NS", (), {"hack_prefill": "auto"})()
    assert settings_from_options(ns, enabled=True).prefill == PrefillMode.AUTO
    roundtrip = settings_mod.EngineSettings.from_json(settings_mod.EngineSettings().to_json())
    assert roundtrip.prefill == PrefillMode.AUTO
    with pytest.raises((ValueError, HackArgumentError), match="prefill must be one of"):
        settings_mod.EngineSettings(prefill="fast")


def test_the_kernels_refuse_auto():
    """'auto' is a server setting: an extend handed it unresolved is a bug, refused by name."""
    cfg = HackConfig()
    store = HackKVStore(cfg, num_layers=1, num_heads=1, head_dim=64, num_pages=2, num_rows=1)
    r2t = torch.arange(128)[None]
    plan = store.plan(r2t, [0], [16], [16])
    x = torch.zeros(16, 1, 64)
    with pytest.raises(ValueError, match="extend prefill must be one of .*got <PrefillMode.AUTO"):
        extend(store, 0, plan, x, x, x, prefill=PrefillMode.AUTO)


def test_dense_attends_in_float32_without_amx_bf16():
    """A BF16 model's dense prefill attends in float32 on a CPU without AMX-BF16 (BF16 SDPA runs
    at about half float32's rate there), in the model's BF16 with AMX or on a GPU; float32
    models are float32 anyway. The float32 attention of BF16 inputs is the closer to exact."""
    assert dense_dtype("cpu", torch.bfloat16, has_amx_bf16=False) == torch.float32
    assert dense_dtype("cpu", torch.bfloat16, has_amx_bf16=True) is None
    assert dense_dtype("cuda", torch.bfloat16, has_amx_bf16=False) is None
    assert dense_dtype("cpu", torch.float32, has_amx_bf16=False) is None
    cfg = HackConfig()
    outs = {}
    for name, dt in (("bf16", None), ("fp32", torch.float32)):
        store = HackKVStore(cfg, num_layers=1, num_heads=2, head_dim=64, num_pages=8, num_rows=1)
        plan = store.plan(torch.arange(512)[None], [0], [300], [300])
        q, k, v = (torch.randn(300, n, 64, generator=torch.Generator().manual_seed(i)).bfloat16()
                   for i, n in ((1, 4), (2, 2), (3, 2)))
        outs[name] = extend(store, 0, plan, q, k, v, prefill=PrefillMode.DENSE, dense_dtype=dt)
        assert outs[name].dtype == torch.bfloat16
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None],
        is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    err = {n: float((o.float() - exact).abs().mean()) for n, o in outs.items()}
    assert err["fp32"] < err["bf16"] and err["fp32"] < 2e-3, err
