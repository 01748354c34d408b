"""The attention backend applies `--hack-rotation` in one place: a HackAttnBackend over an
in-process HackKVPool stores rotated K/V (its FP16 tail holds K·R) and answers extend and decode
exactly like the paged kernels fed rotated q/k/v, with the output rotated back. The flag parses
onto HackConfig, and a head_dim the rotation cannot take is refused before the model loads."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from engine import cpu_runtime  # noqa: E402

cpu_runtime.prepare()

from engine import settings as settings_mod  # noqa: E402
from engine.backend import HackAttnBackend  # noqa: E402
from engine.model_checks import config_refusal, layer_refusal  # noqa: E402
from engine.pool import HackKVPool, pool_build_context  # noqa: E402
from hack_ops import HackConfig  # noqa: E402
from hack_ops.paged import decode, extend  # noqa: E402
from hack_ops.rotation import Rotation, restore_output, rotate_qkv  # noqa: E402

HEADS, QHEADS, DIM = 3, 9, 64


def _pool(monkeypatch, cfg: HackConfig) -> HackKVPool:
    monkeypatch.setenv(settings_mod.ENV_VAR, settings_mod.EngineSettings(config=cfg).to_json())
    with pool_build_context(rows=4, budget=None):
        return HackKVPool(size=64 * 8, page_size=64, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM,
                          layer_num=1, device="cpu", enable_memory_saver=False, v_head_dim=DIM,
                          start_layer=0, end_layer=0)


def _batch(mode, row, seq_len, ext_len):
    return SimpleNamespace(forward_mode=mode, req_pool_indices=torch.tensor([row]),
                           seq_lens_cpu=torch.tensor([seq_len]), extend_seq_lens_cpu=[ext_len], rids=None)


@pytest.mark.parametrize("rot", [Rotation.HADAMARD_KV, Rotation.SIGNED_HADAMARD_V])
def test_backend_rotates_once_around_the_kernels(monkeypatch, rot):
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    cfg = HackConfig(rotation=rot, range_search=False)  # no range search: the same check, faster
    pool = _pool(monkeypatch, cfg)
    plain = _pool(monkeypatch, cfg)  # the kernels alone, fed rotated tensors by hand
    r2t = torch.zeros(4, 512, dtype=torch.int64)
    r2t[1, :192] = torch.arange(192) + 64
    runner = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=r2t),
                             device="cpu", model=None)
    backend = HackAttnBackend(runner)
    assert backend.rotation is rot
    layer = RadixAttention(num_heads=QHEADS, head_dim=DIM, scaling=DIM ** -0.5, num_kv_heads=HEADS, layer_id=0)
    g = torch.Generator().manual_seed(0)
    n = 130
    q = torch.randn(n + 1, QHEADS, DIM, generator=g)
    k = torch.randn(n + 1, HEADS, DIM, generator=g) * (1 + torch.arange(DIM) % 7)
    v = torch.randn(n + 1, HEADS, DIM, generator=g)
    qr, kr, vr = rotate_qkv(q, k, v, rot)
    flat = lambda t: t.reshape(t.shape[0], -1)  # noqa: E731  the model's [tokens, heads * D]

    backend.init_forward_metadata(_batch(ForwardMode.EXTEND, 1, n, n))
    got = backend.forward_extend(flat(q[:n]), flat(k[:n]), flat(v[:n]), layer, None)
    # the prefill the backend resolved (`auto` is dense on some CPUs, engine.prefill_choice)
    want = restore_output(extend(plain.store, 0, plain.store.plan(r2t, [1], [n], [n]), qr[:n], kr[:n], vr[:n],
                                 prefill=backend.prefill), rot)
    assert torch.equal(got, flat(want))
    # the store holds rotated values: the open partition's K tail is K·R (or K when only V rotates)
    tail_k = pool.store.tails["k"][0][1, : n - 128].float()
    assert torch.equal(tail_k, kr[128:n].half().float())
    assert rot.rotates_k == (not torch.equal(tail_k, k[128:n].half().float()))

    backend.init_forward_metadata(_batch(ForwardMode.DECODE, 1, n + 1, 1))
    got = backend.forward_decode(flat(q[n:]), flat(k[n:]), flat(v[n:]), layer, None)
    want = restore_output(decode(plain.store, 0, plain.store.plan(r2t, [1], [n + 1], [1]), qr[n:], kr[n:], vr[n:]), rot)
    assert torch.equal(got, flat(want))
    unrotated = decode(plain.store, 0, plain.store.plan(r2t, [1], [n + 1], [1]), q[n:], k[n:], v[n:])
    assert not torch.allclose(got, flat(unrotated), atol=1e-3)


def test_rotation_flag_parses_and_bad_head_dims_are_refused():
    import argparse

    from sglang.srt.server_args import ServerArgs
    from transformers import AutoConfig

    from engine.args import add_arguments, settings_from_options

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    add_arguments(p)
    ns = p.parse_args(["--model-path", "m", "--kv-cache-dtype", "hack", "--hack-rotation", "hadamard_v"])
    assert settings_from_options(ns, enabled=True).config.rotation is Rotation.HADAMARD_V
    assert settings_from_options(p.parse_args(["--model-path", "m"]), enabled=True).config.rotation is Rotation.NONE
    with pytest.raises(SystemExit):
        p.parse_args(["--model-path", "m", "--hack-rotation", "givens"])
    odd = AutoConfig.for_model("llama", architectures=["LlamaForCausalLM"], hidden_size=288, num_attention_heads=3)
    assert config_refusal(odd) is None  # head_dim 96 is served without a rotation
    reason = config_refusal(odd, rotation="hadamard_kv")
    assert reason == ("--hack-rotation hadamard_kv needs a head_dim that is a power of two (a Walsh-Hadamard "
                      "rotation), got head_dim 96; use --hack-rotation none (model LlamaForCausalLM)")
    from sglang.srt.layers.radix_attention import RadixAttention

    layer = RadixAttention(num_heads=4, head_dim=96, scaling=96 ** -0.5, num_kv_heads=1, layer_id=5)
    assert layer_refusal([layer]) is None
    assert "got head_dim 96" in layer_refusal([layer], rotation="hadamard_k") and "(layer 5)" in layer_refusal(
        [layer], rotation="hadamard_k")
