"""Hypothesis strategies for request bodies of the three generation endpoints.

Two families per endpoint:
  near_valid_bodies  a small valid request with exactly one field replaced by a wrong value,
                     removed, or joined by an unknown field: what a client bug looks like;
  garbage_bodies     arbitrary JSON values, often objects with the endpoint's own keys.
Both keep every valid request cheap: the token budget (max_new_tokens / max_tokens) is only
ever replaced by values that are invalid or tiny, and a garbage object without a budget gets
one of 2 tokens, so a body that happens to be valid costs a few decode steps, not 128 or the
whole context. `n` is likewise only replaced by values <= 4 or invalid ones. Counts are
clamped after drawing too (`_clamped`): a lenient parser reads 5.0 and "5" as 5. What a server
must do with these bodies (never a 5xx, never a dropped connection) is the tests' business;
a 200 is fine for a body that is in fact valid.
"""
from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import strategies as st

from .malformed import Endpoint

SMALL_BUDGET = 2  # tokens a garbage object without a budget may generate
MAX_N = 4  # completions per request a body may ask for
# Values that are wrong for almost any field, plus the numeric edges that checks tend to miss.
EDGE_NUMBERS = (-1, 0, 1, -(2**63), 2**63, 2**70, 10**12, -0.5, 0.5, 1.5, 1e308, -1e308,
                float("nan"), float("inf"), float("-inf"))

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(EDGE_NUMBERS),
)


def json_values(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    """Arbitrary JSON values (NaN and Infinity included: Python's json module writes them and
    SGLang's parsers read them, so they reach the server)."""
    return st.recursive(_scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=max_leaves)


_wrong = st.one_of(json_values(6), st.sampled_from(EDGE_NUMBERS))
# Token budgets and n are only replaced by invalid values or tiny valid ones (see above).
_wrong_budget = st.one_of(
    st.integers(max_value=-1), st.integers(min_value=10**7), st.floats(allow_nan=True),
    st.text(max_size=6), st.booleans(), st.lists(st.integers(), max_size=3),
    st.integers(min_value=0, max_value=SMALL_BUDGET))
_wrong_n = st.one_of(st.integers(max_value=0), st.integers(min_value=1, max_value=MAX_N),
                     st.floats(allow_nan=True), st.text(max_size=4), st.none())
_token_lists = st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=6)
_prompt_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=24)

_BUDGET_KEYS = {"max_new_tokens", "max_tokens", "max_completion_tokens"}
_N_KEYS = {"n", "best_of"}

# Fields mutated in the near-valid family: dotted paths into the base body.
GENERATE_FIELDS = (
    "text", "input_ids", "sampling_params", "stream", "return_logprob", "top_logprobs_num",
    "logprob_start_len", "token_ids_logprob", "return_text_in_logprobs", "rid", "lora_path",
    "sampling_params.max_new_tokens", "sampling_params.min_new_tokens", "sampling_params.temperature",
    "sampling_params.top_p", "sampling_params.top_k", "sampling_params.min_p", "sampling_params.n",
    "sampling_params.stop", "sampling_params.stop_token_ids", "sampling_params.ignore_eos",
    "sampling_params.repetition_penalty", "sampling_params.frequency_penalty",
    "sampling_params.presence_penalty", "sampling_params.regex", "sampling_params.json_schema",
    "sampling_params.logit_bias", "sampling_params.skip_special_tokens", "sampling_params.no_stop_trim",
)
_OPENAI_COMMON = (
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids",
    "stream", "seed", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
    "user", "ignore_eos", "regex", "json_schema", "min_tokens", "skip_special_tokens", "lora_path",
)
COMPLETIONS_FIELDS = ("prompt", "echo", "logprobs", "suffix", "best_of") + _OPENAI_COMMON
CHAT_FIELDS = ("messages", "messages.0", "messages.0.role", "messages.0.content", "logprobs",
               "top_logprobs", "tools", "tool_choice", "response_format", "max_completion_tokens",
               "chat_template_kwargs") + _OPENAI_COMMON

FIELDS = {Endpoint.GENERATE: GENERATE_FIELDS, Endpoint.COMPLETIONS: COMPLETIONS_FIELDS,
          Endpoint.CHAT: CHAT_FIELDS}


@st.composite
def _base(draw: st.DrawFn, endpoint: Endpoint) -> dict:
    """A small valid request (greedy or sampled, 1-2 new tokens)."""
    budget = draw(st.integers(min_value=1, max_value=SMALL_BUDGET))
    temperature = draw(st.sampled_from([0.0, 0.7]))
    if endpoint is Endpoint.GENERATE:
        sp = {"max_new_tokens": budget, "temperature": temperature}
        if draw(st.booleans()):
            return {"text": draw(_prompt_text), "sampling_params": sp}
        ids = draw(st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=8))
        return {"input_ids": ids, "sampling_params": sp}
    if endpoint is Endpoint.COMPLETIONS:
        return {"prompt": draw(_prompt_text), "max_tokens": budget, "temperature": temperature}
    return {"messages": [{"role": "user", "content": draw(_prompt_text)}], "max_tokens": budget,
            "temperature": temperature}


def _replacement(draw: st.DrawFn, leaf: str) -> Any:
    if leaf in _BUDGET_KEYS:
        return draw(_wrong_budget)
    if leaf in _N_KEYS:
        return draw(_wrong_n)
    if leaf in ("input_ids", "prompt", "stop_token_ids", "token_ids_logprob"):
        return draw(st.one_of(_token_lists, _wrong))
    return draw(_wrong)


def _set(body: dict, path: str, value: Any, remove: bool) -> None:
    keys = path.split(".")
    node: Any = body
    for k in keys[:-1]:
        if isinstance(node, list):
            node = node[int(k)]
        else:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):  # the parent itself was replaced: nothing deeper to set
                return
    last = keys[-1]
    if isinstance(node, list):
        if remove:
            node.pop(int(last))
        else:
            node[int(last)] = value
    elif remove:
        node.pop(last, None)
    else:
        node[last] = value


@st.composite
def near_valid_bodies(draw: st.DrawFn, endpoint: Endpoint) -> dict:
    """A valid small request with one field wrong (replaced, removed or an unknown extra)."""
    body = draw(_base(endpoint))
    action = draw(st.sampled_from(["replace", "replace", "replace", "remove", "extra"]))
    if action == "extra":
        body[draw(st.text(min_size=1, max_size=10))] = draw(_wrong)
        return _cap_budget(body, endpoint)  # the extra key may have replaced the budget
    path = draw(st.sampled_from(FIELDS[endpoint]))
    if endpoint is Endpoint.GENERATE and path == "input_ids" and "text" in body:
        body.pop("text")  # replace the prompt's kind instead of sending both
    leaf = path.rsplit(".", 1)[-1]
    if action == "remove" and leaf in _BUDGET_KEYS:
        action = "replace"  # removing the budget would make a valid request expensive
    _set(body, path, None if action == "remove" else _replacement(draw, leaf), action == "remove")
    return _cap_budget(body, endpoint)  # a replaced or removed sampling_params has no budget


def _clamped(value: Any, limit: int) -> Any:
    """`value`, or `limit` in its type where a lenient parser would read it as a count above the
    limit: pydantic takes 5.0 and "5" for an int field, so floats and numeric strings count too.
    Counts of 10**7 and more stay: every server refuses them (longer than any context)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return value
    try:
        x = float(value)
    except (ValueError, OverflowError):
        return value
    if not (math.isfinite(x) and limit < x < 10**7):
        return value
    return type(value)(limit)


def _cap_budget(body: Any, endpoint: Endpoint) -> Any:
    """Give a garbage object a small token budget where it has none (see the module doc)."""
    if not isinstance(body, dict):
        return body
    if endpoint is Endpoint.GENERATE:
        sp = body.get("sampling_params")
        if sp is None:
            body["sampling_params"] = {"max_new_tokens": SMALL_BUDGET}
        elif isinstance(sp, dict) and sp.get("max_new_tokens") is None:
            sp["max_new_tokens"] = SMALL_BUDGET
        elif isinstance(sp, list):
            for item in sp:
                if isinstance(item, dict) and item.get("max_new_tokens") is None:
                    item["max_new_tokens"] = SMALL_BUDGET
    else:
        for key in ("max_tokens", "max_completion_tokens"):
            if body.get(key) is None:
                body[key] = SMALL_BUDGET
    for key in ("n", "best_of"):  # a large valid n multiplies the work: keep it small
        if key in body:
            body[key] = _clamped(body[key], MAX_N)
    sps = body.get("sampling_params")
    for sp in (sps if isinstance(sps, list) else [sps]):
        if isinstance(sp, dict):
            for key, limit in (("max_new_tokens", SMALL_BUDGET), ("n", MAX_N)):
                if key in sp:
                    sp[key] = _clamped(sp[key], limit)
    if endpoint is not Endpoint.GENERATE:
        for key in ("max_tokens", "max_completion_tokens"):
            body[key] = _clamped(body[key], SMALL_BUDGET)
    return body


_KEYS = {Endpoint.GENERATE: ("text", "input_ids", "sampling_params", "stream", "return_logprob"),
         Endpoint.COMPLETIONS: ("prompt", "max_tokens", "temperature", "n", "stop", "logprobs"),
         Endpoint.CHAT: ("messages", "max_tokens", "temperature", "n", "stop", "tools")}


def garbage_bodies(endpoint: Endpoint) -> st.SearchStrategy[Any]:
    """Arbitrary JSON values; objects are often keyed by the endpoint's own field names."""
    keyed = st.dictionaries(st.one_of(st.sampled_from(_KEYS[endpoint]), st.text(max_size=8)),
                            json_values(8), max_size=5)
    return st.one_of(json_values(8), keyed).map(lambda b: _cap_budget(b, endpoint))


def request_bodies(endpoint: Endpoint) -> st.SearchStrategy[bytes]:
    """Both families, serialized exactly as sent."""
    return st.one_of(near_valid_bodies(endpoint), garbage_bodies(endpoint)).map(
        lambda b: json.dumps(b).encode())
