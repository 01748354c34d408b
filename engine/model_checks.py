"""Which model attention features the HACK KV cache serves, checked when the server starts.

Served (CPU and CUDA paths alike): causal decoder self-attention with MHA, GQA or MQA (one KV
head), head_dim a multiple of the HACK head_dim group (64..256 tested; on CUDA a power of two),
per-layer sliding windows (the layer's `sliding_window_size`), the layer's scaling and tanh
logit soft-capping (`logit_cap`).

Refused, with a sentence naming the feature and the flag that works, before anything is served:
  * in the launcher, from the model's HF config (exit status 2 like any bad option):
    multi-head latent attention (MLA), encoder-decoder / cross-attention models, non-causal
    (bidirectional) attention, and models SGLang serves with its hybrid sliding-window pool
    (two pools the HACK pool does not replace: --disable-hybrid-swa-memory gives one pool);
  * in each scheduler, once the model's layers exist (HackAttnBackend.__init__), per layer:
    cross-attention, encoder-only or bidirectional layers, another soft-capping method than
    tanh, K and V head dims that differ, and on CUDA a head_dim the Triton kernels lack (not a
    power of two >= 32);
  * in both places, a head_dim that `--hack-rotation` cannot rotate (not a power of two);
  * in the launcher, `--hack-4bit-layers` naming a layer the model does not have.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from hack_ops.rotation import Rotation, head_dim_refusal

BF16_HINT = "serve it with a BF16 KV cache instead (drop --kv-cache-dtype hack)"


class UnsupportedModelError(ValueError):
    """A model feature the HACK KV cache does not serve (refused at startup)."""


def text_config(hf_config: Any) -> Any:
    """The language model's config (a multimodal config's text part, else the config itself)."""
    return getattr(hf_config, "text_config", None) or hf_config


def architecture(hf_config: Any) -> str:
    """The name a refusal gives the model: its architectures, else its model_type."""
    return ",".join(getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "?")])


def _sentence(feature: str, model: str, hint: str = BF16_HINT) -> str:
    return f"--kv-cache-dtype hack does not serve {feature} (model {model}); {hint}"


def config_refusal(hf_config: Any, disable_hybrid_swa_memory: bool = False,
                   rotation: Rotation | str = Rotation.NONE, four_bit_layers: tuple[int, ...] = ()) -> Optional[str]:
    """The refusal sentence for an HF config's attention features (and the head_dim the
    rotation needs, the layers --hack-4bit-layers names), or None when served."""
    text, arch = text_config(hf_config), architecture(hf_config)
    if getattr(text, "kv_lora_rank", None) or getattr(hf_config, "kv_lora_rank", None):
        return _sentence("multi-head latent attention (MLA)", arch)
    if getattr(hf_config, "is_encoder_decoder", False) or getattr(text, "cross_attention_layers", None):
        return _sentence("cross-attention (an encoder-decoder model)", arch)
    if getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False:
        return _sentence("non-causal (bidirectional) attention", arch)
    if not disable_hybrid_swa_memory and _hybrid_swa(hf_config, text):
        return _sentence("SGLang's hybrid sliding-window KV pool", arch,
                         "add --disable-hybrid-swa-memory (one pool; the HACK backend applies each layer's "
                         "window) or drop --kv-cache-dtype hack")
    d = _config_head_dim(text)
    reason = head_dim_refusal(rotation, d) if d else None
    if reason:
        return f"{reason} (model {arch})"
    n = getattr(text, "num_hidden_layers", None)
    beyond = [i for i in four_bit_layers if n is not None and i >= int(n)]
    if beyond:
        return (f"--hack-4bit-layers names layer{'s' if len(beyond) > 1 else ''} {','.join(map(str, beyond))}, "
                f"but model {arch} has {int(n)} layers (0..{int(n) - 1})")
    return None


def _config_head_dim(text: Any) -> Optional[int]:
    d = getattr(text, "head_dim", None)
    if d:
        return int(d)
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    return int(hidden) // int(heads) if hidden and heads else None


def _hybrid_swa(hf_config: Any, text: Any) -> bool:
    from sglang.srt.configs.model_config import is_hybrid_swa_model

    try:
        return bool(is_hybrid_swa_model(list(getattr(hf_config, "architectures", None) or []), text))
    except Exception:  # an odd config: SGLang itself will judge it
        return False


def check_model_path(model_path: str, trust_remote_code: bool = False,
                     disable_hybrid_swa_memory: bool = False,
                     rotation: Rotation | str = Rotation.NONE, four_bit_layers: tuple[int, ...] = ()) -> Optional[str]:
    """config_refusal for a local model folder; None when there is no readable config (SGLang
    reports a missing or broken model itself)."""
    import os

    if not model_path or not os.path.isfile(os.path.join(model_path, "config.json")):
        return None
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except Exception:
        return None
    return config_refusal(cfg, disable_hybrid_swa_memory, rotation, four_bit_layers)


def layer_refusal(layers: Iterable[Any], gpu: bool = False,
                  rotation: Rotation | str = Rotation.NONE) -> Optional[str]:
    """The refusal sentence for the first RadixAttention layer the HACK paths cannot serve."""
    for layer in layers:
        name = f"layer {getattr(layer, 'layer_id', '?')}"
        kind = getattr(getattr(layer, "attn_type", None), "value", "decoder")
        if getattr(layer, "is_cross_attention", False):
            return _sentence("cross-attention layers", name)
        if kind == "encoder_only":
            return _sentence("encoder-only attention layers", name)
        if kind != "decoder":
            return _sentence(f"non-causal attention layers ({kind})", name)
        cap = getattr(layer, "logit_cap", 0.0) or 0.0
        method = getattr(layer, "logit_capping_method", "tanh")
        if cap > 0 and method != "tanh":
            return _sentence(f"logit soft-capping by {method!r} (tanh is served)", name)
        if getattr(layer, "qk_head_dim", 0) != getattr(layer, "v_head_dim", 0):
            return _sentence("different K and V head dims", name)
        d = getattr(layer, "qk_head_dim", 0) or getattr(layer, "head_dim", 0)
        if gpu and (d < 32 or d & (d - 1)):
            return _sentence(f"head_dim {d} on CUDA (the HACK Triton kernels take powers of two >= 32)",
                             name, "serve it on the CPU path or with a BF16 KV cache")
        reason = head_dim_refusal(rotation, d)
        if reason:
            return f"{reason} ({name})"
    return None


def check_model_layers(model: Any, gpu: bool = False, rotation: Rotation | str = Rotation.NONE) -> None:
    """Raise UnsupportedModelError for a model whose attention layers HACK cannot serve."""
    if model is None:
        return
    from sglang.srt.layers.radix_attention import RadixAttention

    reason = layer_refusal((m for m in model.modules() if isinstance(m, RadixAttention)), gpu=gpu,
                           rotation=rotation)
    if reason:
        raise UnsupportedModelError(reason)
