"""The accuracy study: how far each KV format moves a real model from its exact self.

Teacher-forced over windows of real text (essays and plays): perplexity, mean KL divergence to
the exact model's next-token distribution, and top-1 agreement with the exact model. Greedy
generation on HumanEval prompts: character edit similarity of each variant's continuation to
the exact model's. Results are written as JSON and as docs/accuracy.md.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hack_ops.config import RaisedTensors, raised_tensors
from hack_ops.rotation import Rotation

from .models import DEFAULT_MODEL, prepare

MODEL_TITLES = {
    "smollm2": "SmolLM2-135M-Instruct (Q4_1 GGUF weights, float32)",
    "gemma3": "Gemma-3-270M (Q4_K_M GGUF weights, float32; 5 of 6 layers with a 512-token window)",
}
from .attention_paths import AttentionPath, attention_path
from .runner import EXACT, Variant, greedy, hidden_for, load_model, logits_from_hidden, row_path
from .texts import essay_files, humaneval_prompts, play_files, token_windows
from .variants import (byte_ratio, core_variants, generation_variants, layer_bits_variants, quick_variants,
                       select_variants, sparse_variants, study_variants)


@dataclass
class Tally:
    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    tokens: int = 0
    seq_ppl: list = field(default_factory=list)
    edit_sim: list = field(default_factory=list)
    seconds: float = 0.0


def edit_similarity(a: str, b: str) -> float:
    """1 - Levenshtein(a, b) / max(len): 1.0 for identical strings."""
    if not a and not b:
        return 1.0
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return 1.0 - prev[-1] / max(len(a), len(b))


def _key(v: Variant) -> str:
    return f"{v.mode}:{v.name}"


SCORE_ROWS = 256  # positions scored at a time: [rows, vocab] temporaries instead of [context, vocab]


@torch.inference_mode()
def _score_window(model, hidden: dict[str, torch.Tensor], tallies: dict[str, Tally], targets: torch.Tensor) -> None:
    """Score every variant's hidden states of one window against the exact model's (the first
    entry of `hidden`), SCORE_ROWS positions at a time: each position's logits are computed
    once per variant and [rows, vocab] is the largest temporary."""
    keys = list(hidden)
    sums = {k: [0.0, 0.0, 0] for k in keys}  # nll, kl, top-1
    n = targets.numel()
    for lo in range(0, n, SCORE_ROWS):
        hi = min(lo + SCORE_ROWS, n)
        ref = ref_p = None
        for k in keys:
            t0 = time.time()
            logp = torch.log_softmax(logits_from_hidden(model, hidden[k][lo:hi]), -1)
            if ref is None:  # the exact model comes first
                ref, ref_p = logp, logp.exp()
            acc = sums[k]
            acc[0] += -logp.gather(1, targets[lo:hi, None]).sum().item()
            acc[1] += (ref_p * (ref - logp)).sum().item()
            acc[2] += int((logp.argmax(-1) == ref.argmax(-1)).sum().item())
            tallies[k].seconds += time.time() - t0
    for k, (nll_sum, kl, top1) in sums.items():
        t = tallies[k]
        t.nll += nll_sum
        t.tokens += n
        t.seq_ppl.append(math.exp(nll_sum / n))
        t.kl += kl
        t.top1 += top1


def run_study(
    context: int = 2048,
    essays: int = 3,
    plays: int = 3,
    gen_prompts: int = 5,
    gen_tokens: int = 48,
    quick: bool = False,
    core: bool = False,
    threads: int | None = None,
    log=print,
    model_name: str = DEFAULT_MODEL,
    variant_patterns: list[str] | None = None,
    path: AttentionPath | str = AttentionPath.FAST,
    modes: list[str] | None = None,
    four_bit_layers: tuple[int, ...] | None = None,
    variants: list[Variant] | None = None,
    raised: tuple[RaisedTensors | str, ...] = (RaisedTensors.KV,),
    four_bit_rotation: Rotation | str = Rotation.NONE,
    sparse_budgets: tuple[int, ...] = (),
    sparse_refine: int = 1,
    sparse_score: str = "bound",
    sparse_refined_only: bool = False,
) -> dict:
    """sparse_budgets: add the default format under sparse decode at these token budgets
    (variants.sparse_variants, in `modes` or both modes; refined too with sparse_refine > 1, or
    only refined with sparse_refined_only; pages ranked by sparse_score). variant_patterns: instead of the quick/core/full set, the rows of the full study whose
    name or config label contains one of these (plus the exact baseline). path: where the
    attention runs (attention_paths.AttentionPath; rows the fast paths refuse run on the
    reference either way, and each row records where it ran). modes: with variant_patterns,
    only the rows in these AttentionModes. four_bit_layers: add the default format with these
    layers at 4 bits (layer_bits_variants), in `modes` or both modes, one row per entry of
    `raised` (K and V, or K alone), rotated by `four_bit_rotation`. variants: the rows
    themselves (the exact baseline first), instead of any selection."""
    path = attention_path(path)
    explicit = variants is not None
    if variants is not None:
        if variant_patterns is not None or quick or core or four_bit_layers or sparse_budgets:
            raise ValueError("explicit variants replace every other row selection")
        if not variants or variants[0] != EXACT:
            raise ValueError("explicit variants start with the exact baseline")
    elif variant_patterns is not None:
        if quick or core:
            raise ValueError("--variants replaces --quick/--core (it selects from the full study); give one")
        variants = select_variants(study_variants(), variant_patterns, modes)  # before the model loads: fails fast
    elif modes is not None and not sparse_budgets:
        raise ValueError("--modes filters the rows --variants (or --sparse-budgets) selects; give --variants too")
    else:
        variants = quick_variants() if quick else core_variants() if core else study_variants()
    raised_rows = layer_bits_variants(four_bit_layers, modes, raised, four_bit_rotation) if four_bit_layers else []
    raised_rows += (sparse_variants(sparse_budgets, modes, sparse_refine, score=sparse_score,
                                    refined_only=sparse_refined_only) if sparse_budgets else [])
    variants = variants + raised_rows
    torch.manual_seed(0)  # stochastic-rounding variants draw from the global generator
    model, tok = load_model(prepare(model_name, log=log), threads=threads)
    cfg = model.config
    windows = token_windows(tok, essay_files(), context, essays)
    windows += token_windows(tok, play_files(), context, plays, skip_chars=4000)
    if len(windows) < essays + plays:
        raise RuntimeError(f"only {len(windows)} windows of {context} tokens found")
    tallies = {_key(v): Tally() for v in variants}
    for i, ids in enumerate(windows):
        hidden = {}
        for v in variants:  # EXACT first
            t0 = time.time()
            hidden[_key(v)] = hidden_for(model, ids[:-1], v, path)
            tallies[_key(v)].seconds += time.time() - t0
        _score_window(model, hidden, tallies, torch.tensor(ids[1:]))
        log(f"window {i + 1}/{len(windows)} done")
    gen_vars = [EXACT, variants[1]] if quick else generation_variants()[:3] if core else generation_variants()
    if variant_patterns is not None:  # generation for the selected homomorphic rows only
        gen_vars = [EXACT] + [v for v in variants[1:] if v.mode == "hack"]
    # and for the layer-bits rows (their 'hack' mode), whatever the set
    gen_vars = gen_vars + [v for v in raised_rows if v.mode == "hack" and v not in gen_vars]
    prompts = humaneval_prompts()[:gen_prompts]
    for p in prompts:
        ids = tok(p["prompt"], add_special_tokens=False)["input_ids"]
        ref = tok.decode(greedy(model, ids, EXACT, gen_tokens, path))
        for v in gen_vars[1:]:
            out = tok.decode(greedy(model, ids, v, gen_tokens, path))
            tallies.setdefault(_key(v), Tally()).edit_sim.append(edit_similarity(ref, out))
    log(f"generation on {len(prompts)} prompts done")
    base = tallies[_key(EXACT)]
    base_ppl = math.exp(base.nll / base.tokens)
    rows = []
    for v in variants:
        t = tallies[_key(v)]
        ppl = math.exp(t.nll / t.tokens)
        ratios = [a / b for a, b in zip(t.seq_ppl, base.seq_ppl)]
        rows.append({
            "variant": v.name, "mode": v.mode,
            "config": None if v.config is None else v.config.label(),
            "bytes_vs_bf16": byte_ratio(v.config, cfg.num_key_value_heads, cfg.head_dim, context,
                                        cfg.num_hidden_layers),
            "ppl": ppl, "ppl_ratio": ppl / base_ppl,
            "ppl_ratio_min": min(ratios), "ppl_ratio_max": max(ratios),
            "kl": t.kl / t.tokens, "top1": t.top1 / t.tokens,
            "edit_similarity": (sum(t.edit_sim) / len(t.edit_sim)) if t.edit_sim else None,
            "seconds": t.seconds,
            "attention_path": row_path(v, path).value,
        })
    return {
        "model": MODEL_TITLES.get(model_name, model_name),
        "context": context, "windows": {"essays": essays, "plays": plays},
        "predicted_tokens": base.tokens, "gen_prompts": len(prompts), "gen_tokens": gen_tokens,
        "variant_set": ("explicit" if explicit else "selected" if variant_patterns is not None
                        else "quick" if quick else "core" if core else "full"),
        "four_bit_layers": list(four_bit_layers or []),
        "raised_tensors": [raised_tensors(t).value for t in raised] if four_bit_layers else [],
        "four_bit_rotation": Rotation(four_bit_rotation).value if four_bit_layers else Rotation.NONE.value,
        "sparse_budgets": list(sparse_budgets),
        "variant_patterns": variant_patterns, "modes": modes, "attention_path": path.value, "rows": rows,
    }


def save(results: dict, json_path: Path) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1))
