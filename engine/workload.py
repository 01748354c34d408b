"""Fixed prompts for the serving tests and `hack bench serve` (real text, offline).

Short prompts are written here; long ones are exact-length token windows of Paul Graham's
essays (hack_eval.texts), so both servers of a comparison see identical token ids.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

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
def tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def essay_ids(model_path: str | Path, length: int, index: int = 0) -> list[int]:
    """`length` token ids from the `index`-th essay long enough (BOS-free, exact length)."""
    from hack_eval.texts import essay_files, token_windows

    wins = token_windows(tokenizer(str(model_path)), essay_files(), length, index + 1)
    if len(wins) <= index:
        raise ValueError(f"fewer than {index + 1} essays hold {length} tokens")
    return wins[index]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
