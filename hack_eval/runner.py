"""Run a transformers model with its attention replaced by the study's (attention_paths.py).

The model computes Q, K, V (post-RoPE) as usual; our function receives them and applies the
chosen variant: 'exact' float32 attention, 'hack' (2-bit cache, homomorphic, INT8 Q/P) or
'dequant', on the dense reference hack_ops.attention or on the fast paths held to it. With
decode-time visibility, a teacher-forced pass over a whole sequence sees exactly the cache that
token-by-token generation would hold. A variant whose config has a rotation is rotated by
hack_ops.rotation.rotate_qkv / restore_output, the functions the serving backend calls around
its kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from hack_ops import AttentionMode, HackConfig
from hack_ops.modes import attention_mode

from hack_ops.sparse import SparseConfig
from hack_ops.static_keep import StaticKeep, keep_mask

from .attention_paths import AttentionPath, QuantizedTensors, attention_path, fast_refusal, study_attention

ATTN_NAME = "hack_reference"


@dataclass(frozen=True)
class Variant:
    """A row of a study. layers: the 0-based layers whose KV cache is quantized (the others run
    exact attention; None: every layer). tensors: which of K and V are quantized (QuantizedTensors;
    K or V alone in 'dequant' mode only). Both serve the per-layer breakdown (`hack eval layers`)."""

    name: str
    mode: AttentionMode  # strings are accepted and stored as the enum
    config: HackConfig | None = None
    layers: tuple[int, ...] | None = None
    tensors: QuantizedTensors = QuantizedTensors.KV
    sparse: SparseConfig | None = None  # sparse decode in every query (hack_ops.sparse), its layers only
    static: StaticKeep | None = None  # static eviction after the prompt (prompt_boundary), layers without a window

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", attention_mode(self.mode))  # frozen: coerced once, here
        object.__setattr__(self, "tensors", QuantizedTensors(self.tensors))
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(sorted({int(i) for i in self.layers})))
        if self.tensors != QuantizedTensors.KV and self.mode != AttentionMode.DEQUANT:
            raise ValueError(f"K or V alone is measured in 'dequant' mode only, not {self.mode.value!r}")
        if self.static is not None and self.static.enabled and (self.mode != AttentionMode.DEQUANT
                                                                or self.sparse is not None):
            raise ValueError("static eviction is studied in 'dequant' mode, without sparse decode")

    def describe(self) -> str:
        return "exact float32 attention" if self.config is None else f"{self.mode} {self.config.label()}"


EXACT = Variant("exact", AttentionMode.EXACT, None)
_current: list[tuple[Variant, AttentionPath]] = [(EXACT, AttentionPath.FAST)]
# Attention outputs a study already computed, by layer: that layer returns it instead of
# attending (hack_eval.calibrate measures each tensor's 2-bit output once, then its effect).
_overrides: dict[int, torch.Tensor] = {}
# The prompt's length while a pass scores a prompt and its answer (prompt_boundary): positions
# from it on are decode steps, which static eviction restricts; None: no boundary.
_prompt: list[int | None] = [None]
# Collectors of each layer's kept pages under static eviction (record_kept).
_kept_logs: list[dict[int, torch.Tensor]] = []
# Callbacks that see every layer's attention inputs (layer, q, k, scale, window, logit_cap, v),
# post-RoPE, before the variant's attention runs: how a study reads where the model looks.
_probes: list[Callable[..., None]] = []


def _attention_fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                  softcap=None, **kwargs):
    if query.shape[0] != 1:
        # No padding support: every sequence of the study runs alone, so no mask is needed.
        raise ValueError("the study runs one sequence at a time (batch 1)")
    var, path = _current[-1]
    # HF's sliding_window counts the query itself (kv > q - w); hack_ops takes SGLang's w - 1.
    window = None if not sliding_window else int(sliding_window) - 1
    for probe in _probes:
        probe(int(module.layer_idx), query, key, scaling, window, softcap or 0.0, value)
    if int(module.layer_idx) in _overrides:
        return _overrides[int(module.layer_idx)].transpose(1, 2).contiguous().to(query.dtype), None
    cfg, mode, tensors = var.config, var.mode, var.tensors
    if var.layers is not None and int(module.layer_idx) not in var.layers:  # this layer stays exact
        cfg, mode, tensors = None, AttentionMode.EXACT, QuantizedTensors.KV
    if cfg is not None and cfg.per_layer:  # e.g. more bits for the first and last layer
        cfg = cfg.for_layer(int(module.layer_idx), int(module.config.num_hidden_layers))
    sparse = var.sparse if var.sparse is not None and var.sparse.layer_is_sparse(int(module.layer_idx), window) \
        and mode != AttentionMode.EXACT else None
    static = _static_cut(var, mode, int(module.layer_idx), window, query, key, scaling, softcap or 0.0,
                         cfg.partition_size if cfg is not None else 0)
    out = study_attention(query, key, value, cfg, mode, scale=scaling, window=window,
                          logit_cap=softcap or 0.0, path=path, tensors=tensors, sparse=sparse, static=static)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def _static_cut(var: Variant, mode: AttentionMode, layer: int, window: int | None, query: torch.Tensor,
                key: torch.Tensor, scaling: float | None, logit_cap: float,
                page_size: int) -> tuple[torch.Tensor, int] | None:
    """(the layer's kept prompt pages [H, N], the prompt's length) under the variant's static
    eviction, or None where it does not apply (off, exact rows, window layers, no boundary, or
    no position past the prompt in this pass)."""
    plen = _prompt[-1]
    st = var.static
    if st is None or not st.enabled or mode == AttentionMode.EXACT or window is not None or plen is None \
            or key.shape[2] <= plen or query.shape[2] != key.shape[2]:
        return None
    h, d = key.shape[1], key.shape[3]
    q = query[0].reshape(h, query.shape[1] // h, query.shape[2], d)  # query head i reads KV head i // R
    scale = d ** -0.5 if scaling is None else float(scaling)
    kept = keep_mask(q, key[0], plen, page_size, st, scale, logit_cap)
    for log in _kept_logs:
        log[layer] = kept
    return kept, plen


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention_fn)


def row_path(v: Variant, path: AttentionPath) -> AttentionPath:
    """Where a variant's teacher-forced passes run when `path` is asked for (a per-layer config
    reaches the attention resolved into one uniform config per layer, which is what is asked)."""
    cfg = v.config
    if cfg is not None and cfg.per_layer:
        cfg = cfg.replace(edge_layer_bits=0, four_bit_layers=(), four_bit_k_layers=(), four_bit_v_layers=())
    if v.sparse is not None and v.sparse.enabled and v.mode == AttentionMode.HACK:
        return AttentionPath.REFERENCE  # the serving extend kernel has no per-query selection
    return AttentionPath.REFERENCE if fast_refusal(cfg, v.mode) is not None else path


class use_variant:
    """Context manager selecting the variant every attention layer applies, and where its
    attention runs (attention_paths.AttentionPath: the fast paths by default)."""

    def __init__(self, variant: Variant, path: AttentionPath | str = AttentionPath.FAST):
        self.variant = variant
        self.path = attention_path(path)

    def __enter__(self) -> Variant:
        _current.append((self.variant, self.path))
        return self.variant

    def __exit__(self, *exc) -> None:
        _current.pop()


class prompt_boundary:
    """Context manager: the passes inside score a prompt of `prompt_len` tokens followed by its
    answer; positions from prompt_len on are decode steps (static eviction applies to them)."""

    def __init__(self, prompt_len: int):
        self.prompt_len = int(prompt_len)

    def __enter__(self) -> int:
        _prompt.append(self.prompt_len)
        return self.prompt_len

    def __exit__(self, *exc) -> None:
        _prompt.pop()


class record_kept:
    """Context manager: a dict filled, per layer, with the kept prompt pages [H, N] of the
    static eviction the passes inside apply (the last pass's, where several run)."""

    def __enter__(self) -> dict[int, torch.Tensor]:
        self.log: dict[int, torch.Tensor] = {}
        _kept_logs.append(self.log)
        return self.log

    def __exit__(self, *exc) -> None:
        del _kept_logs[next(i for i, log in enumerate(_kept_logs) if log is self.log)]


class override_attention:
    """Context manager: layer `layer` returns `out` ([1, Hq, m, D] float32, what study_attention
    returns) as its attention output while it is active, whatever the variant."""

    def __init__(self, layer: int, out: torch.Tensor):
        self.layer, self.out = layer, out

    def __enter__(self) -> None:
        _overrides[self.layer] = self.out

    def __exit__(self, *exc) -> None:
        _overrides.pop(self.layer, None)


class probe_attention:
    """Context manager: `callback(layer, q, k, scale, window, logit_cap, v)` is called by every
    attention layer with its inputs (q [1, Hq, m, D], k and v [1, H, n, D]) while it is active."""

    def __init__(self, callback: Callable[..., None]):
        self.callback = callback

    def __enter__(self) -> None:
        _probes.append(self.callback)

    def __exit__(self, *exc) -> None:
        _probes.remove(self.callback)


def model_geometry(model) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a loaded transformers model."""
    c = model.config
    heads = int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    return int(c.num_hidden_layers), heads, head_dim


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
def hidden_for(model, ids: list[int], variant: Variant, path: AttentionPath | str = AttentionPath.FAST) -> torch.Tensor:
    """The last hidden states [len(ids), hidden] (after the final norm) under `variant`: the
    logits of any positions follow with logits_from_hidden, so a study never holds
    [len(ids), vocab] at once (Gemma-3's 262,144-token vocabulary at 8K is 8.6 GB)."""
    with use_variant(variant, path):
        x = torch.tensor([ids], dtype=torch.long)
        return model.model(input_ids=x, use_cache=False).last_hidden_state[0]


@torch.inference_mode()
def logits_from_hidden(model, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits of the given hidden states, as the model's own forward computes them
    (its output projection, then its final soft-cap when it has one)."""
    logits = model.lm_head(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if not cap else torch.tanh(logits / cap) * cap


@torch.inference_mode()
def greedy(model, ids: list[int], variant: Variant, max_new_tokens: int,
           path: AttentionPath | str = AttentionPath.FAST) -> list[int]:
    """Greedy continuation under `variant` (KV kept by transformers in float; our attention
    quantizes it exactly as the serving cache would hold it). The prompt takes `path`; each
    generated token is a step over transformers' cache, which runs on the reference."""
    with use_variant(variant, path):
        x = torch.tensor([ids], dtype=torch.long)
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=model.config.eos_token_id)
        return out[0, len(ids):].tolist()
