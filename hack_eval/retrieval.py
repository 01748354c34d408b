"""Passkey retrieval: a number hidden at a chosen depth of a long essay document, the model asked
for it at the end. Where perplexity averages over every token, this task fails when one detail
far back in the cache is lost, which is what a 2-bit cache risks.

Scoring is exact match of greedy decoding, computed teacher-forced: greedy decoding reproduces
the answer exactly when the argmax at every answer position is the next answer token given the
answer so far, so one forward pass over prompt + answer decides it (instead of one pass per
generated token), and only the answer positions' logits are computed.
"""
from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hack_ops.config import RaisedTensors, raised_tensors
from hack_ops.rotation import Rotation
from hack_ops.static_keep import StaticKeep

from .attention_paths import AttentionPath, attention_path
from .report import report_head
from .runner import (EXACT, Variant, model_geometry, probe_attention, prompt_boundary, record_kept, row_path,
                     use_variant)
from .workloads import encode, essay_stream

# The classic passkey prompt (Mohtashami & Jaggi, 2023): the fact is stated twice so a small
# base model can copy it; what is measured is whether the cache still holds it.
INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about it.\n\n")
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER = " {key}"
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
HAYSTACK_OFFSETS = 20_000  # tokens of essay text beyond the longest prompt to draw haystacks from


@dataclass(frozen=True)
class Item:
    """One question: `ids` is prompt + answer; the answer is ids[answer_start:]; the needle
    sentence (the key stated twice) is ids[needle_start:needle_start + needle_len]."""

    context: int
    depth: float
    key: str
    ids: tuple[int, ...]
    answer_start: int
    needle_start: int = 0
    needle_len: int = 0


def build_items(tok: Any, contexts: list[int], per_cell: int, seed: int = 0,
                depths: tuple[float, ...] = DEPTHS) -> list[Item]:
    """`per_cell` items for each context length (prompt + answer tokens), spread over `depths`
    in turn; keys are seeded 5-digit numbers."""
    if per_cell < 1:
        raise ValueError("need at least one item per context")
    rng = random.Random(seed)
    enc = lambda text: encode(tok, text)  # noqa: E731
    intro, question = enc(INTRO), enc(QUESTION)
    # One token stream over the essays; each item's haystack starts at a seeded offset in it,
    # so items differ in their text as well as their key.
    stream = essay_stream(tok, max(contexts) + HAYSTACK_OFFSETS)
    items: list[Item] = []
    for context in contexts:
        for i in range(per_cell):
            key = str(rng.randrange(10_000, 100_000))
            needle, answer = enc(NEEDLE.format(key=key)), enc(ANSWER.format(key=key))
            n_fill = context - len(intro) - len(needle) - len(question) - len(answer)
            if n_fill < 16:
                raise ValueError(f"context {context} is too short for the passkey prompt")
            depth = depths[i % len(depths)]
            start = rng.randrange(0, max(1, len(stream) - n_fill))
            fill = stream[start:start + n_fill]
            if len(fill) < n_fill:
                raise ValueError(f"the essays hold {len(stream)} tokens, fewer than a {context}-token prompt")
            cut = int(round(depth * n_fill))
            prompt = intro + fill[:cut] + needle + fill[cut:] + question
            items.append(Item(context, depth, key, tuple(prompt + answer), len(prompt),
                              needle_start=len(intro) + cut, needle_len=len(needle)))
    return items


def items_digest(items: list[Item]) -> dict[str, str]:
    """Per context, a short hash of its items' tokens (prompt and answer, in order): two runs asked
    the same questions at a context exactly where their digests agree, whatever flags built them."""
    by_context: dict[int, Any] = {}
    for it in items:
        h = by_context.setdefault(it.context, hashlib.sha256())
        h.update(len(it.ids).to_bytes(4, "little") + b"".join(t.to_bytes(4, "little") for t in it.ids))
    return {str(c): h.hexdigest()[:12] for c, h in by_context.items()}


@torch.inference_mode()
def answered(model: Any, item: Item, variant: Variant, path: AttentionPath | str = AttentionPath.FAST) -> bool:
    """Whether greedy decoding under `variant` would produce the item's answer exactly."""
    n_answer = len(item.ids) - item.answer_start
    with use_variant(variant, path), prompt_boundary(item.answer_start):
        x = torch.tensor([item.ids], dtype=torch.long)
        # The logits at positions answer_start-1 .. len-2 predict the answer tokens.
        logits = model(input_ids=x, use_cache=False, logits_to_keep=n_answer + 1).logits[0, :-1]
    return bool(torch.equal(logits.argmax(-1), torch.tensor(item.ids[item.answer_start:])))


@torch.inference_mode()
def needle_attention(model: Any, items: list[Item], log: Callable[[str], None] = print) -> list[dict]:
    """Where the exact model looks for the key: per layer, the attention mass that the answer's
    positions (the question's last token and the answer tokens) put on the needle sentence,
    averaged over those positions and the items, for the head that puts the most there (and the
    mean over heads). The layers at the top hold the retrieval heads a question relies on."""
    from hack_ops.attention import soft_cap, visible

    sums: dict[int, torch.Tensor] = {}
    current: dict[str, Any] = {}

    def probe(layer: int, q: torch.Tensor, k: torch.Tensor, scale: float | None, window: int | None,
              cap: float, v: torch.Tensor | None = None) -> None:
        item: Item = current["item"]
        rows = torch.arange(item.answer_start - 1, len(item.ids) - 1)
        qr = q[0, :, rows].float()  # [Hq, rows, D]
        kf = k[0].float().repeat_interleave(q.shape[1] // k.shape[1], 0)  # [Hq, n, D]
        sc = qr.shape[-1] ** -0.5 if scale is None else scale
        s = soft_cap(qr @ kf.transpose(-1, -2) * sc, cap)
        keys = torch.arange(kf.shape[1])
        s = s.masked_fill(~visible(keys[None, :], rows[:, None], window), float("-inf"))
        p = torch.softmax(s, -1)[..., item.needle_start:item.needle_start + item.needle_len]
        mass = p.sum(-1).mean(-1)  # [Hq]
        sums[layer] = sums.get(layer, torch.zeros_like(mass)) + mass

    with probe_attention(probe), use_variant(EXACT):
        for n, item in enumerate(items):
            current["item"] = item
            model.model(input_ids=torch.tensor([item.ids]), use_cache=False)
            log(f"needle attention: item {n + 1}/{len(items)} done")
    rows = []
    for layer in sorted(sums):
        m = sums[layer] / len(items)
        rows.append({"layer": layer, "max_head_mass": float(m.max()), "head": int(m.argmax()),
                     "mean_mass": float(m.mean())})
    return rows


def run_retrieval(model: Any, variants: list[Variant], items: list[Item], log: Callable[[str], None] = print,
                  path: AttentionPath | str = AttentionPath.FAST) -> list[dict]:
    """Exact-match accuracy of each variant per context on `items` (build_items; the same for
    all), with the accuracy at each depth; `path` is where the attention runs (attention_paths)."""
    path = attention_path(path)
    contexts = list(dict.fromkeys(item.context for item in items))  # in the order they were built
    hits: dict[tuple[str, str, int], list[tuple[float, bool]]] = {}
    seconds: dict[tuple[str, str, int], float] = {}
    wire: dict[tuple[str, str, int], list[dict]] = {}
    for n, item in enumerate(items):
        for v in variants:
            k = (v.name, str(v.mode), item.context)
            t0 = time.time()
            with record_kept() as kept:
                hits.setdefault(k, []).append((item.depth, answered(model, item, v, path)))
            seconds[k] = seconds.get(k, 0.0) + time.time() - t0
            if v.static is not None and v.static.enabled:
                wire.setdefault(k, []).append({**static_wire(model, v, item.answer_start, kept),
                                               "needle_kept": needle_kept(item, kept, v.config.partition_size)})
        log(f"retrieval item {n + 1}/{len(items)} (context {item.context}, depth {item.depth}) done")
    rows = []
    for v in variants:
        for context in contexts:
            k = (v.name, str(v.mode), context)
            got = hits[k]
            by_depth = {}
            for d in sorted({d for d, _ in got}):
                at = [ok for dd, ok in got if dd == d]
                by_depth[str(d)] = sum(at) / len(at)
            rows.append({
                "variant": v.name, "mode": str(v.mode),
                "config": None if v.config is None else v.config.label(),
                "context": context, "items": len(got), "accuracy": sum(ok for _, ok in got) / len(got),
                "by_depth": by_depth, "seconds": seconds[k], "attention_path": row_path(v, path).value,
            })
            if k in wire:
                rows[-1]["static"] = {"keep": v.static.keep, "observe": v.static.observe,
                                      "unit": v.static.unit.value,
                                      **{f: sum(w[f] for w in wire[k]) / len(wire[k]) for f in wire[k][0]}}
    return rows


def static_wire(model: Any, variant: Variant, prompt_len: int, kept: dict[int, torch.Tensor]) -> dict:
    """What static eviction saves on the PD wire for one prompt: hack-pages bytes with every
    page sent and with the kept pages only (hack_ops.page_wire), against BF16's bytes for the
    same tokens, the fraction of the prompt's closed pages a decode step reads, and the fraction
    of its page slots some layer still keeps (what decode could not free; 1.0 unless every layer
    evicts)."""
    from hack_ops.page_wire import model_kept_request_bytes, model_request_bytes

    layers, heads, dim = model_geometry(model)
    bf16 = 2 * 2 * layers * heads * dim * prompt_len
    full = model_request_bytes(variant.config, layers, heads, dim, prompt_len)
    sent = model_kept_request_bytes(variant.config, layers, heads, dim, prompt_len, kept)
    read = [float(m.float().mean()) for m in kept.values() if m.numel()]
    # A page's slot holds every layer's page: decode could free it only if every layer drops it.
    slots = (torch.stack([m.any(0) for m in kept.values()]).any(0).float().mean()
             if len(kept) == layers and next(iter(kept.values())).numel() else torch.tensor(1.0))
    return {"wire_vs_bf16": sent / bf16, "wire_all_pages_vs_bf16": full / bf16, "wire_vs_all_pages": sent / full,
            "pages_read": sum(read) / len(read) if read else 1.0, "layers_evicting": float(len(kept)),
            "slots_needed": float(slots)}


def needle_kept(item: Item, kept: dict[int, torch.Tensor], page_size: int) -> float:
    """The fraction of (layer, KV head) pairs under static eviction that kept every closed page
    the needle sentence touches (1.0 where it is only in the open partition)."""
    pages = list(range(item.needle_start // page_size, (item.needle_start + item.needle_len - 1) // page_size + 1))
    rows = [m[:, [p for p in pages if p < m.shape[-1]]].all(-1).float() for m in kept.values()]
    return float(torch.cat(rows).mean()) if rows else 1.0


def run_study_retrieval(model_name: str, contexts: list[int], per_cell: int, seed: int = 0,
                        variant_patterns: list[str] | None = None, threads: int | None = None,
                        log: Callable[[str], None] = print, path: AttentionPath | str = AttentionPath.FAST,
                        modes: list[str] | None = None, four_bit_layers: tuple[int, ...] | None = None,
                        needle: bool = False, raised: tuple[RaisedTensors | str, ...] = (RaisedTensors.KV,),
                        four_bit_rotation: Rotation | str = Rotation.NONE, variants: list[Variant] | None = None,
                        static: tuple[StaticKeep, ...] = ()) -> dict:
    """`hack eval retrieval`: load the model, score exact plus the selected study rows (and the
    default format with `four_bit_layers` at 4 bits, variants.layer_bits_variants, one row per
    entry of `raised`, rotated by `four_bit_rotation`), or the given `variants` instead; each
    'dequant' row also under every static eviction of `static` (variants.static_variants)."""
    from .accuracy import MODEL_TITLES
    from .models import prepare
    from .runner import load_model
    from .variants import layer_bits_variants, select_variants, static_variants, study_variants

    if variants is None:
        variants = select_variants(study_variants(), variant_patterns or ["=default"], modes)  # fails before loading
        if four_bit_layers:
            variants = variants + layer_bits_variants(four_bit_layers, modes, raised, four_bit_rotation)
    if static:
        variants = variants + static_variants(variants, static)
    torch.manual_seed(seed)  # stochastic-rounding variants draw from the global generator
    model, tok = load_model(prepare(model_name, log=log), threads=threads)
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if limit and max(contexts) > limit:
        raise ValueError(f"context {max(contexts)} is beyond the model's {limit} positions")
    items = build_items(tok, contexts, per_cell, seed)
    rows = run_retrieval(model, variants, items, log=log, path=path)
    attn = needle_attention(model, items, log=log) if needle else None
    return {"model": MODEL_TITLES.get(model_name, model_name), "contexts": contexts, "items_per_context": per_cell,
            "seed": seed, "items_digest": items_digest(items), "depths": list(DEPTHS),
            "attention_path": attention_path(path).value,
            "four_bit_layers": list(four_bit_layers or []),
            "raised_tensors": [raised_tensors(t).value for t in raised] if four_bit_layers else [],
            "four_bit_rotation": Rotation(four_bit_rotation).value if four_bit_layers else Rotation.NONE.value,
            "prompt": {"intro": INTRO, "needle": NEEDLE, "question": QUESTION, "answer": ANSWER},
            "rows": rows, "needle_attention": attn}


def _digest_note(digest: dict[str, str] | None) -> str:
    if not digest:
        return ""
    cells = ", ".join(f"{c} `{d}`" for c, d in digest.items())
    return (f" Items by context (items_digest, a hash of their tokens; another run asked the same questions "
            f"exactly where its digest is the same): {cells}.")


def render_retrieval(results: dict, command: str) -> str:
    """The markdown report of a retrieval run."""
    depths = [str(d) for d in results["depths"]]
    how = (f", decoded by real SGLang servers, one per KV method (KV budget {results.get('budget_mb', 0):g} MB "
           "each)" if results.get("served") else " (scored teacher-forced: one pass over prompt and answer)")
    lines = report_head(
        "Passkey retrieval",
        f"Model: {results['model']}. {results['items_per_context']} items per context, seed "
        f"{results['seed']}: a 5-digit pass key stated twice at depth "
        f"{', '.join(depths)} (in turn) of a Paul Graham essay haystack, then asked for; exact match "
        f"of greedy decoding{how}. Zero-shot; the prompt is in the JSON next to this file."
        + " The items come from one seeded sequence over the contexts in the order given, and their haystacks "
          "from as much essay text as the longest context asks, so a context's items are another run's only "
          "where the contexts before it and the longest context were the same."
        + _digest_note(results.get("items_digest")), command) + [
        "| variant | mode | config | context | exact match | " + " | ".join(f"depth {d}" for d in depths)
        + " | seconds |",
        "|---|---|---|---|---|" + "---|" * len(depths) + "---|",
    ]
    for r in results["rows"]:
        cells = [f"{r['by_depth'][d] * 100:.0f}%" if d in r["by_depth"] else "—" for d in depths]
        lines.append(f"| {r['variant']} | {r['mode']} | {r['config'] or '—'} | {r['context']} | "
                     f"{r['accuracy'] * 100:.1f}% ({r['items']}) | " + " | ".join(cells) + f" | {r['seconds']:.0f} |")
    static = [r for r in results["rows"] if r.get("static")]
    if static:
        lines += ["", "Static eviction (hack_ops.static_keep: after the prompt, the closed pages its last "
                  "queries ignore are dropped for every decode step and left off the PD wire), per prompt on "
                  "average: the prompt's closed pages a decode step reads, and the hack-pages wire bytes "
                  "against BF16's for the same tokens, with every page sent and with the kept pages only:", "",
                  "| variant | context | pages read | needle's pages kept (layers x heads) | page slots some layer "
                  "keeps | wire vs BF16, all pages | wire vs BF16, kept pages | exact match |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['variant']} | {r['context']} | {r['static']['pages_read'] * 100:.1f}% | "
                  f"{r['static']['needle_kept'] * 100:.1f}% | {r['static']['slots_needed'] * 100:.1f}% | "
                  f"{r['static']['wire_all_pages_vs_bf16'] * 100:.1f}% | "
                  f"{r['static']['wire_vs_bf16'] * 100:.1f}% | {r['accuracy'] * 100:.1f}% |" for r in static]
    attn = results.get("needle_attention")
    if attn:
        ranked = sorted(attn, key=lambda r: -r["max_head_mass"])
        lines += ["", "Where the exact model looks for the key (attention mass of the answer positions on the "
                  "needle sentence, the layer's top head and the mean over heads), layers by the top head:", "",
                  "| layer | top head | its mass | mean over heads |", "|---|---|---|---|"]
        lines += [f"| {r['layer']} | {r['head']} | {r['max_head_mass']:.3f} | {r['mean_mass']:.3f} |" for r in ranked]
    return "\n".join(lines) + "\n"
