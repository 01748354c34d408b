"""The text `hack calibrate` measures on, and its needle items: GSM8K's training problems (MIT,
data/gsm8k/train.jsonl in the shared data folder beside the repository, DEFAULT_PATH), less the 300 that
datasets/gsm8k_sample.jsonl holds for the disaggregation workloads. No evaluation reads them:
the accuracy study reads essays and plays, the pass-key items hide their key in essays, the
recall and fidelity prompts are essays and ShareGPT turns. The needle is worded unlike the
pass key of `hack eval retrieval` ("access code", not "pass key"), so a plan is not tuned to
that prompt.
"""
from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .workloads import DATASETS_DIR, REPO_ROOT, encode

ENV_VAR = "HACK_CALIBRATION_TEXT"  # another JSONL of {"question", "answer"} rows
DEFAULT_PATH = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"

INTRO = "Below are solved math problems. An access code is hidden among them: find it and keep it.\n\n"
NEEDLE = "\nNote: the access code is {key}. Keep it: the access code is {key}.\n"
QUESTION = "\n\nWhat is the access code? The access code is"
ANSWER = " {key}"


def text_path() -> Path:
    """The calibration JSONL: $HACK_CALIBRATION_TEXT, else GSM8K's training split in shared/."""
    path = Path(os.environ.get(ENV_VAR) or DEFAULT_PATH)
    if not path.is_file():
        raise FileNotFoundError(f"no calibration text at {path}: set {ENV_VAR} to a JSONL file of "
                                "{\"question\", \"answer\"} rows (GSM8K's train.jsonl)")
    return path


def problems(seed: int = 0) -> list[str]:
    """The problems as 'Question: ...\\nAnswer: ...' texts (calculator marks removed), in a seeded
    order, without those of the workloads' sample."""
    rows = [json.loads(line) for line in text_path().read_text().splitlines() if line.strip()]
    sample = DATASETS_DIR / "gsm8k_sample.jsonl"
    held = {json.loads(line)["question"] for line in sample.read_text().splitlines() if line.strip()} \
        if sample.is_file() else set()
    texts = [f"Question: {r['question']}\nAnswer: {re.sub(r'<<[^>]*>>', '', r['answer'])}\n\n"
             for r in rows if r["question"] not in held]
    random.Random(seed).shuffle(texts)
    return texts


@dataclass(frozen=True)
class CalibrationItem:
    """prompt + answer ids; the answer is ids[answer_start:]; the needle sits at needle_start."""

    ids: tuple[int, ...]
    answer_start: int
    needle_start: int
    needle_len: int


def build_items(tok: Any, context: int, count: int, seed: int = 0) -> list[CalibrationItem]:
    """`count` items of `context` tokens: a haystack of problems with a seeded 5-digit access code
    at depths spread over 0.1..0.5 (one item: 0.1), far back (past a 512-token window at 768
    tokens and more), then the question."""
    if count < 1:
        raise ValueError("calibration needs at least one item")
    rng = random.Random(seed)
    stream: list[int] = []
    texts = iter(problems(seed))
    need = count * context
    for t in texts:
        stream += encode(tok, t)
        if len(stream) >= need:
            break
    intro, question = encode(tok, INTRO), encode(tok, QUESTION)
    items = []
    for i in range(count):
        key = str(rng.randrange(10_000, 100_000))
        needle, answer = encode(tok, NEEDLE.format(key=key)), encode(tok, ANSWER.format(key=key))
        n_fill = context - len(intro) - len(needle) - len(question) - len(answer)
        fill = stream[i * context:i * context + n_fill]
        if n_fill < 64 or len(fill) < n_fill:
            raise ValueError(f"calibration context {context} is too short, or the text too small, for {count} items")
        depth = 0.1 + 0.4 * (i / (count - 1)) if count > 1 else 0.1
        cut = int(round(depth * n_fill))
        prompt = intro + fill[:cut] + needle + fill[cut:] + question
        items.append(CalibrationItem(tuple(prompt + answer), len(prompt), len(intro) + cut, len(needle)))
    return items
