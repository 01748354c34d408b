"""engine.model_checks: which attention features the HACK KV cache refuses, with which sentence.
The launcher-level refusal of a real `python -m sglang.launch_server` is in
tests/test_engine_startup.py; here the decisions themselves, from HF configs and RadixAttention
layers built in process."""
from __future__ import annotations

import pytest

from engine.model_checks import UnsupportedModelError, check_model_layers, config_refusal, layer_refusal


def _cfg(model_type: str, **kw):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kw)


@pytest.mark.parametrize("model_type, kw, feature, flag", [
    ("deepseek_v3", dict(architectures=["DeepseekV3ForCausalLM"], kv_lora_rank=64), "multi-head latent attention",
     "drop --kv-cache-dtype hack"),
    ("t5", dict(architectures=["T5ForConditionalGeneration"]), "cross-attention", "drop --kv-cache-dtype hack"),
    ("gemma3_text", dict(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True), "non-causal",
     "drop --kv-cache-dtype hack"),
    ("gpt_oss", dict(architectures=["GptOssForCausalLM"]), "hybrid sliding-window KV pool",
     "--disable-hybrid-swa-memory"),
])
def test_refused_configs(model_type, kw, feature, flag):
    reason = config_refusal(_cfg(model_type, **kw))
    assert reason and reason.startswith("--kv-cache-dtype hack does not serve ") and feature in reason and flag in reason


def test_served_configs():
    # Gemma-3 (sliding windows, one KV head, head_dim 256, query_pre_attn_scalar) and Llama
    assert config_refusal(_cfg("gemma3_text", architectures=["Gemma3ForCausalLM"], sliding_window=512)) is None
    assert config_refusal(_cfg("llama", architectures=["LlamaForCausalLM"])) is None
    # a hybrid-SWA model with one pool is served (each layer's window is applied by the backend)
    assert config_refusal(_cfg("gpt_oss", architectures=["GptOssForCausalLM"]), disable_hybrid_swa_memory=True) is None


def _layer(**kw):
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(num_heads=4, head_dim=256, scaling=256 ** -0.5, num_kv_heads=1, layer_id=3, **kw)


def test_layers():
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention

    served = [_layer(), _layer(sliding_window_size=511), _layer(logit_cap=50.0)]
    assert layer_refusal(served) is None
    # windows and soft-caps are served on CUDA too (the Triton kernels have them)
    assert layer_refusal(served + [_layer(sliding_window_size=511, logit_cap=30.0)], gpu=True) is None
    odd = RadixAttention(num_heads=4, head_dim=96, scaling=96 ** -0.5, num_kv_heads=1, layer_id=5)
    assert layer_refusal([odd]) is None  # the CPU path takes head_dim 96
    assert "head_dim 96 on CUDA" in layer_refusal([odd], gpu=True)
    assert "cross-attention layers (model layer 3)" in layer_refusal(served + [_layer(is_cross_attention=True)])
    assert "encoder-only" in layer_refusal([_layer(attn_type=AttentionType.ENCODER_ONLY)])
    assert "non-causal" in layer_refusal([_layer(attn_type=AttentionType.DECODER_BIDIRECTIONAL)])
    assert "soft-capping by 'foo'" in layer_refusal([_layer(logit_cap=30.0, logit_capping_method="foo")])

    class Model:  # what HackAttnBackend passes: the model, whose modules() holds the layers
        def modules(self):
            return iter([object(), _layer(is_cross_attention=True)])

    with pytest.raises(UnsupportedModelError, match="BF16 KV cache"):
        check_model_layers(Model())
    check_model_layers(None)  # no model (unit tests of the backend): nothing to check
