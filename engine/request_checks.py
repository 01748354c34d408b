"""Request checks SGLang 0.5.23 lacks: bad input must get a 4xx, never reach the scheduler.

Out-of-vocabulary `input_ids` (negative or >= vocab size) pass SGLang's validation and crash the
scheduler inside the embedding lookup, which takes the whole server down. They are refused in
the tokenizer manager, where SGLang's own ValueErrors become HTTP 400 responses.
"""
from __future__ import annotations

from typing import Any


def check_input_ids(vocab_size: int, input_ids: Any) -> None:
    if input_ids is None:
        return
    if not isinstance(input_ids, (list, tuple)):
        raise ValueError("input_ids must be a list of integers")
    for i, tok in enumerate(input_ids):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise ValueError(f"input_ids[{i}] is {tok!r}; token ids must be integers")
        if not 0 <= tok < vocab_size:
            raise ValueError(f"input_ids[{i}] = {tok} is outside the vocabulary [0, {vocab_size})")
