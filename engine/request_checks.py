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


# The generation endpoints whose body must be one JSON object (engine.http_guard checks it).
GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
_JSON_WHITESPACE = b" \t\r\n"


def body_shape_error(body: bytes) -> str | None:
    """Why a generation request's body cannot be a request, or None. SGLang's chat request
    model reads a body that is JSON but not an object (an array, a string, a number, null) in a
    validator that assumes a dict and answers 500; every generation endpoint gets the same 400
    here. Only the first byte is looked at: an object that is not valid JSON is SGLang's to
    refuse (it answers 400), and an empty body too."""
    head = body.lstrip(_JSON_WHITESPACE)[:1]
    if not head or head == b"{":
        return None
    return "the request body must be a JSON object ({...})"
