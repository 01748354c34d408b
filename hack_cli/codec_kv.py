"""Real KV of a prepared model for the codec's calibration and benchmark.

Runs the model with transformers (CPU, its BF16 weights) on a few prompts and returns, per
layer, the K (after rotary embedding, as SGLang stores it) and V tensors of its KV cache.
"""
from __future__ import annotations

from pathlib import Path

import torch

# Short, varied prompts: an essay opening, code, arithmetic, chat.
DEFAULT_PROMPTS = (
    "The history of the printing press begins long before Gutenberg. In China, woodblock printing "
    "was used to reproduce texts and images as early as the ninth century, and movable type made "
    "of ceramic appeared in the eleventh. What changed in fifteenth-century Europe was the "
    "combination of a metal alloy, an oil-based ink and a screw press adapted from wine making.",
    "def fibonacci(n: int) -> list[int]:\n    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n"
    "    out = [0, 1]\n    while len(out) < n:\n        out.append(out[-1] + out[-2])\n    return out[:n]\n",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Let's think step by step.",
    "User: Can you explain why the sky is blue in two sentences?\nAssistant:",
)


def collect(model_path: str | Path, prompts: tuple[str, ...] = DEFAULT_PROMPTS,
            repeat: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(K, V)] per layer, each [tokens over all prompts, kv_heads, head_dim] in BF16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.bfloat16)
    model.eval()
    per_layer: list[tuple[list, list]] = []
    with torch.no_grad():
        for text in prompts:
            ids = tok(text * repeat, return_tensors="pt").input_ids
            cache = model(ids, use_cache=True).past_key_values
            for i, (k, v) in enumerate(_layers(cache)):
                if len(per_layer) <= i:
                    per_layer.append(([], []))
                # [1, heads, tokens, dim] -> [tokens, heads, dim], SGLang's per-token layout
                per_layer[i][0].append(k[0].transpose(0, 1).contiguous())
                per_layer[i][1].append(v[0].transpose(0, 1).contiguous())
    return [(torch.cat(ks).to(torch.bfloat16), torch.cat(vs).to(torch.bfloat16)) for ks, vs in per_layer]


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers 5: DynamicCache.layers[i].keys/values
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(k, v) for k, v in cache]
