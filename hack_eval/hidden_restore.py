"""HCache's restore (seed 002) on a Hugging Face decoder: a layer's K and V rebuilt from the hidden
state that entered the layer, by the layer's own pre-attention norm, K/V projections, K norm
(Gemma-3) and rotary embedding, instead of re-running the model over the context.

    hidden = capture_layer_inputs(model, ids)                # what a server would keep per layer
    k, v = restore_layer_kv(model, layer, hidden[layer], positions)

restore_layer_kv runs the same modules in the same order as the model's attention, so in the model's
dtype its K/V equal the forward pass's bit for bit (tests/test_hidden_restore.py, SmolLM2 and
Gemma-3); stored in another dtype (BF16 hidden states of a float32 model) they differ by that
rounding. hack_cli/bench_restore.py weighs this source against reloading HACK pages and against
recompute.
"""
from __future__ import annotations

import inspect
import sys

import torch
from torch import Tensor


def decoder_layers(model) -> list:
    """The decoder layers of a causal LM (Llama, Qwen2, Gemma-3 families: model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: hidden-state restore supports decoder-only "
                         "models with pre-attention norms (Llama, Qwen2, Gemma-3 families)")
    return list(layers)


@torch.inference_mode()
def capture_layer_inputs(model, ids: Tensor) -> tuple[list[Tensor], object]:
    """One forward pass over ids [N] (a single sequence): each decoder layer's input hidden states
    [N, hidden] (what HCache stores), and the pass's KV cache of every token in every layer (the
    reference a restore must equal)."""
    layers = decoder_layers(model)
    inputs: list[Tensor | None] = [None] * len(layers)
    handles = []
    for i, layer in enumerate(layers):
        def grab(module, args, kwargs, i=i):
            h = args[0] if args else kwargs["hidden_states"]
            inputs[i] = h[0].detach().clone()
        handles.append(layer.register_forward_pre_hook(grab, with_kwargs=True))
    from transformers import DynamicCache

    try:
        # A plain cache: every layer keeps every token (the model's default cache would keep only
        # the window of Gemma-3's sliding layers; a HACK pool keeps them all, as SGLang does).
        out = model(input_ids=ids[None], use_cache=True, past_key_values=DynamicCache())
    finally:
        for h in handles:
            h.remove()
    return inputs, out.past_key_values


def _rope(model, layer, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin of the layer's rotary embedding (per layer type where the model has several)."""
    rotary = model.model.rotary_emb
    attn = layer.self_attn
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return rotary(x, positions[None], getattr(attn, "layer_type", None))
    return rotary(x, positions[None])


@torch.inference_mode()
def restore_layer_kv(model, layer_idx: int, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """K (after RoPE) and V [N, kv_heads, head_dim] of one layer from its input hidden states
    [N, hidden] at `positions` [N]: the layer's input norm, K/V projections, K norm, RoPE."""
    layer = decoder_layers(model)[layer_idx]
    attn = layer.self_attn
    x = layer.input_layernorm(hidden[None])  # [1, N, hidden]
    d = attn.head_dim
    k = attn.k_proj(x).view(1, x.shape[1], -1, d).transpose(1, 2)  # [1, H, N, D], as the attention holds it
    v = attn.v_proj(x).view(1, x.shape[1], -1, d).transpose(1, 2)
    if getattr(attn, "k_norm", None) is not None:
        k = attn.k_norm(k)
    cos, sin = _rope(model, layer, x, positions)
    apply = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    _, k = apply(k, k, cos, sin)
    return k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()


def cached_kv(cache, layer_idx: int) -> tuple[Tensor, Tensor]:
    """K and V [N, kv_heads, head_dim] a forward pass left in its cache for one layer."""
    lay = cache.layers[layer_idx]
    return lay.keys[0].transpose(0, 1), lay.values[0].transpose(0, 1)


def hidden_bytes_per_token(model, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes HCache stores per token: every layer's input hidden state."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return len(decoder_layers(model)) * cfg.hidden_size * torch.empty((), dtype=dtype).element_size()
