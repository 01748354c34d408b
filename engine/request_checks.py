"""Request checks SGLang 0.5.23 lacks: bad input must get a 4xx, never reach the scheduler.

Each check here guards a value that passes SGLang's own validation and then crashes the
scheduler, which takes the whole server down:
  - out-of-vocabulary `input_ids` (negative or >= vocab size): the embedding lookup;
  - `top_logprobs_num` (OpenAI: `logprobs` / `top_logprobs`) above the vocabulary: the top-k
    over the logits (found by the fuzz tests, tests/test_fuzz_api.py).
They run in the tokenizer manager, where SGLang's own ValueErrors become HTTP 400 responses.
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


def check_top_logprobs_num(vocab_size: int, top_logprobs_num: Any) -> None:
    """The number of top logprobs asked per position: at most the vocabulary (the top-k over the
    logits cannot return more). Negative values mean none upstream and are left alone."""
    values = top_logprobs_num if isinstance(top_logprobs_num, (list, tuple)) else [top_logprobs_num]
    for k in values:
        if isinstance(k, int) and not isinstance(k, bool) and k > vocab_size:
            raise ValueError(f"top_logprobs_num (OpenAI: logprobs / top_logprobs) is {k}; "
                             f"at most the vocabulary size {vocab_size} can be returned")
