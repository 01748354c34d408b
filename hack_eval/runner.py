"""Run a transformers model with its attention replaced by hack_ops.attention.

The model computes Q, K, V (post-RoPE) as usual; our function receives them and applies the
chosen variant: 'exact' float32 attention, 'hack' (2-bit cache, homomorphic, INT8 Q/P) or
'dequant'. With decode-time visibility in hack_ops.attention, a teacher-forced pass over a whole
sequence sees exactly the cache that token-by-token generation would hold. A variant whose
config has a rotation is rotated inside hack_ops.attention by hack_ops.rotation.rotate_qkv /
restore_output, the functions the serving backend calls around its kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hack_ops import AttentionMode, HackConfig, attention
from hack_ops.modes import attention_mode

ATTN_NAME = "hack_reference"


@dataclass(frozen=True)
class Variant:
    name: str
    mode: AttentionMode  # strings are accepted and stored as the enum
    config: HackConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", attention_mode(self.mode))  # frozen: coerced once, here

    def describe(self) -> str:
        return "exact float32 attention" if self.config is None else f"{self.mode} {self.config.label()}"


EXACT = Variant("exact", AttentionMode.EXACT, None)
_current: list[Variant] = [EXACT]


def _attention_fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                  softcap=None, **kwargs):
    if query.shape[0] != 1:
        # No padding support: every sequence of the study runs alone, so no mask is needed.
        raise ValueError("the study runs one sequence at a time (batch 1)")
    var = _current[-1]
    # HF's sliding_window counts the query itself (kv > q - w); hack_ops takes SGLang's w - 1.
    window = None if not sliding_window else int(sliding_window) - 1
    cfg = var.config
    if cfg is not None and cfg.per_layer:  # e.g. more bits for the first and last layer
        cfg = cfg.for_layer(int(module.layer_idx), int(module.config.num_hidden_layers))
    out = attention(query, key, value, cfg, mode=var.mode, causal=True, scale=scaling, window=window,
                    logit_cap=softcap or 0.0)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention_fn)


class use_variant:
    """Context manager selecting the variant every attention layer applies."""

    def __init__(self, variant: Variant):
        self.variant = variant

    def __enter__(self) -> Variant:
        _current.append(self.variant)
        return self.variant

    def __exit__(self, *exc) -> None:
        _current.pop()


def load_model(path: Path, threads: int | None = None):
    """The HF folder in float32 with the study's attention function."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    _register()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=ATTN_NAME)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    return model, tok


@torch.inference_mode()
def logits_for(model, ids: list[int], variant: Variant) -> torch.Tensor:
    """Teacher-forced logits [len(ids), vocab] (float32) under `variant`."""
    with use_variant(variant):
        x = torch.tensor([ids], dtype=torch.long)
        return model(input_ids=x, use_cache=False).logits[0].float()


@torch.inference_mode()
def greedy(model, ids: list[int], variant: Variant, max_new_tokens: int) -> list[int]:
    """Greedy continuation under `variant` (KV kept by transformers in float; our attention
    quantizes it exactly as the serving cache would hold it)."""
    with use_variant(variant):
        x = torch.tensor([ids], dtype=torch.long)
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=model.config.eos_token_id)
        return out[0, len(ids):].tolist()
