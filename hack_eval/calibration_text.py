"""The text `hack calibrate` measures on, and its needle items. No evaluation reads any of it:
the accuracy study reads the first essays and the first plays (hack_eval.texts, in file order),
the pass-key items hide their key in essays, the recall prompts are essays and the fidelity
prompts the first ShareGPT conversations. The needle is worded unlike the pass key of `hack eval
retrieval` ("access code", not "pass key"), so a plan is not tuned to that prompt.

Three kinds of text (CalibrationText), because a plan measured on one genre does not carry to
another (docs/accuracy.md, "Calibrated bits"):
  * plays: the last HELD_OUT_PLAYS Shakespeare plays in file order, which the accuracy study never
    reaches (tests/test_calibrate_text.py);
  * chat: ShareGPT conversations from CHAT_FIRST on, every turn (the workloads and the fidelity
    prompts read the first few thousand);
  * gsm8k: GSM8K's training problems (MIT, data/gsm8k/train.jsonl in the shared data folder beside
    the repository, or $HACK_CALIBRATION_TEXT), less the 300 that datasets/gsm8k_sample.jsonl
    holds for the disaggregation workloads.
The default, mix, takes item i's haystack from plays, chat and gsm8k in turn.
"""
from __future__ import annotations

import enum
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .workloads import DATASETS_DIR, REPO_ROOT, encode, sharegpt_conversations

ENV_VAR = "HACK_CALIBRATION_TEXT"  # another JSONL of {"question", "answer"} rows
DEFAULT_PATH = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
HELD_OUT_PLAYS = 6  # the last plays in file order; the accuracy study reads the first ones
CHAT_FIRST = 12_000  # ShareGPT conversations before this index are the workloads' and the fidelity prompts'
PLAY_SKIP_CHARS = 4000  # a play's Gutenberg header

INTRO = "Below is some text. An access code is hidden in it: find it and keep it.\n\n"
NEEDLE = "\nNote: the access code is {key}. Keep it: the access code is {key}.\n"
QUESTION = "\n\nWhat is the access code? The access code is"
ANSWER = " {key}"


class CalibrationText(str, enum.Enum):
    """Where an item's haystack comes from (`hack calibrate --text`)."""

    MIX = "mix"  # plays, chat and gsm8k in turn, item by item (the default)
    PLAYS = "plays"
    CHAT = "chat"
    GSM8K = "gsm8k"


def _gsm8k_path() -> Path:
    return Path(os.environ.get(ENV_VAR) or DEFAULT_PATH)


def text_path() -> Path:
    """The GSM8K JSONL: $HACK_CALIBRATION_TEXT, else GSM8K's training split in shared/."""
    path = _gsm8k_path()
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


def held_out_plays() -> list[Path]:
    """The plays no evaluation reads: the last HELD_OUT_PLAYS in file order."""
    from .texts import play_files

    files = play_files()
    if len(files) <= 2 * HELD_OUT_PLAYS:
        raise FileNotFoundError(f"only {len(files)} plays found; the calibration holds out the last {HELD_OUT_PLAYS}")
    return files[-HELD_OUT_PLAYS:]


def plays(seed: int = 0) -> list[str]:
    """The held-out plays' texts past their headers, in a seeded order."""
    texts = [p.read_text(encoding="utf-8", errors="replace")[PLAY_SKIP_CHARS:] for p in held_out_plays()]
    random.Random(seed).shuffle(texts)
    return texts


def _first_pair(conv: list[dict]) -> tuple[str, str] | None:
    if len(conv) >= 2 and conv[0].get("from") == "human" and conv[1].get("from") == "gpt":
        return str(conv[0].get("value", "")), str(conv[1].get("value", ""))
    return None


def chats(seed: int = 0, limit: int = 400) -> list[str]:
    """Up to `limit` ShareGPT conversations from CHAT_FIRST on, every turn as 'User: ...' /
    'Assistant: ...', in a seeded order. Left out: those under 2,000 characters or not in ASCII (a
    haystack of many tiny conversations, or of scripts the models barely read, measures little),
    and those whose first turn and reply one of the first CHAT_FIRST conversations repeats word for
    word (ShareGPT holds duplicates)."""
    out: list[str] = []
    early: set[tuple[str, str]] = set()
    for index, conv in enumerate(sharegpt_conversations(), start=1):
        if len(out) >= limit:
            break
        pair = _first_pair(conv)
        if index <= CHAT_FIRST:
            if pair is not None:
                early.add(pair)
            continue
        if pair is not None and pair in early:
            continue
        body = "\n\n".join(("User: " if c.get("from") == "human" else "Assistant: ") + str(c.get("value", ""))
                           for c in conv)
        if len(body) >= 2000 and body.isascii():
            out.append(body + "\n\n")
    if not out:
        raise FileNotFoundError(f"no ShareGPT conversations past the first {CHAT_FIRST} in the shipped file")
    random.Random(seed).shuffle(out)
    return out


_SOURCES: dict[CalibrationText, Callable[[int], list[str]]] = {
    CalibrationText.PLAYS: plays, CalibrationText.CHAT: chats, CalibrationText.GSM8K: problems}


def item_sources(text: CalibrationText | str, count: int) -> list[CalibrationText]:
    """The haystack kind of each of `count` items."""
    text = CalibrationText(text)
    if text != CalibrationText.MIX:
        return [text] * count
    order = (CalibrationText.PLAYS, CalibrationText.CHAT, CalibrationText.GSM8K)
    return [order[i % len(order)] for i in range(count)]


@dataclass(frozen=True)
class CalibrationItem:
    """prompt + answer ids; the answer is ids[answer_start:]; the needle sits at needle_start."""

    ids: tuple[int, ...]
    answer_start: int
    needle_start: int
    needle_len: int
    source: CalibrationText = CalibrationText.GSM8K


def build_items(tok: Any, context: int, count: int, seed: int = 0,
                text: CalibrationText | str = CalibrationText.MIX) -> list[CalibrationItem]:
    """`count` items of `context` tokens: a haystack of `text` (item_sources) with a seeded 5-digit
    access code at depths spread over 0.1..0.5 (one item: 0.1), far back (past a 512-token window
    at 768 tokens and more), then the question. Items of one kind read consecutive stretches of it."""
    if count < 1:
        raise ValueError("calibration needs at least one item")
    rng = random.Random(seed)
    kinds = item_sources(text, count)
    intro, question = encode(tok, INTRO), encode(tok, QUESTION)
    streams: dict[CalibrationText, list[int]] = {}
    used: dict[CalibrationText, int] = {}
    for kind in dict.fromkeys(kinds):
        need, stream = kinds.count(kind) * context, []
        for t in _SOURCES[kind](seed):
            stream += encode(tok, t)
            if len(stream) >= need:
                break
        streams[kind], used[kind] = stream, 0
    items = []
    for i, kind in enumerate(kinds):
        key = str(rng.randrange(10_000, 100_000))
        needle, answer = encode(tok, NEEDLE.format(key=key)), encode(tok, ANSWER.format(key=key))
        n_fill = context - len(intro) - len(needle) - len(question) - len(answer)
        fill = streams[kind][used[kind]:used[kind] + n_fill]
        used[kind] += context
        if n_fill < 64 or len(fill) < n_fill:
            raise ValueError(f"calibration context {context} is too short, or the {kind.value} text too small, "
                             f"for {count} items")
        depth = 0.1 + 0.4 * (i / (count - 1)) if count > 1 else 0.1
        cut = int(round(depth * n_fill))
        prompt = intro + fill[:cut] + needle + fill[cut:] + question
        items.append(CalibrationItem(tuple(prompt + answer), len(prompt), len(intro) + cut, len(needle), kind))
    return items


def describe(text: CalibrationText | str) -> str:
    """One line for a plan's record of what it was measured on."""
    text = CalibrationText(text)
    parts = {CalibrationText.PLAYS: f"the last {HELD_OUT_PLAYS} Shakespeare plays (held out of the accuracy study)",
             CalibrationText.CHAT: f"ShareGPT conversations past the first {CHAT_FIRST}",
             CalibrationText.GSM8K: f"{_gsm8k_path().parent.name}/{_gsm8k_path().name} (GSM8K train less the "
                                    "workloads' sample)"}
    kinds = list(parts) if text == CalibrationText.MIX else [text]
    return "; ".join(parts[k] for k in kinds) + ", an access code hidden in each item"
