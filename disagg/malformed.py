"""A fixed catalogue of malformed requests for the three generation endpoints, and a sender.

Every item must be answered with a 4xx by a healthy server (colocated or behind the PD
router): never a 5xx, never a dropped connection, and the server keeps serving. The items are
model-agnostic (token ids far outside any vocabulary, prompts longer than any context a model
here has), so the same list serves the fuzz tests and `hack bench soak`, which interleaves
them into its load. `send` never raises: a connection that failed or timed out reads 0.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

import requests


class Endpoint(str, Enum):
    GENERATE = "/generate"
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


JSON = "application/json"
# Longer than the context of every model this project serves (SmolLM2 8K, Gemma-3-270M 32K) and
# than the usual 128K of larger ones; token id 1 exists in every vocabulary.
TOO_LONG_TOKENS = 140_000
FAR_OUT_OF_VOCAB = 1 << 40  # also past int32, where an unchecked id would overflow a tensor


@dataclass(frozen=True)
class BadRequest:
    name: str  # short, unique: "generate-text-not-string", ...
    path: str  # an Endpoint value
    body: bytes  # exactly what is sent (may be invalid JSON)
    content_type: str = JSON  # "" sends no Content-Type header


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _gen(**fields: Any) -> dict:
    """A valid /generate body (a short greedy request) with `fields` replacing its own."""
    body: dict[str, Any] = {"text": "The capital of France is",
                            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
    body.update(fields)
    return body


def _gen_sp(**params: Any) -> dict:
    """A valid /generate body whose sampling_params get `params` on top of its own."""
    return _gen(sampling_params={"max_new_tokens": 4, "temperature": 0.0, **params})


def _cmpl(**fields: Any) -> dict:
    body: dict[str, Any] = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.0}
    body.update(fields)
    return body


def _chat(**fields: Any) -> dict:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Say hello."}],
                            "max_tokens": 4, "temperature": 0.0}
    body.update(fields)
    return body


def _envelope_items(prefix: str, path: str, valid: dict) -> list[BadRequest]:
    """What is wrong with the body as a whole, the same for every endpoint."""
    return [
        BadRequest(f"{prefix}-invalid-json", path, b'{"text": "unterminated'),
        BadRequest(f"{prefix}-empty-body", path, b""),
        BadRequest(f"{prefix}-json-array", path, b"[1, 2, 3]"),
        BadRequest(f"{prefix}-json-string", path, b'"hello"'),
        BadRequest(f"{prefix}-json-null", path, b"null"),
        BadRequest(f"{prefix}-json-number", path, b"42"),
        BadRequest(f"{prefix}-not-utf8", path, b'{"text": "\xff\xfe"}'),
        BadRequest(f"{prefix}-wrong-content-type", path, _json(valid), content_type="text/plain"),
    ]


def _generate_items() -> list[BadRequest]:
    g = Endpoint.GENERATE.value
    items = _envelope_items("generate", g, _gen())
    bodies: dict[str, dict] = {
        "no-input": {"sampling_params": {"max_new_tokens": 4}},
        "text-not-string": _gen(text=123),
        "text-object": _gen(text={"a": 1}),
        "text-nested-list": _gen(text=[["a", "b"]]),
        "input-ids-not-list": {**_gen(text=None), "input_ids": "1 2 3"},
        "input-ids-floats": {**_gen(text=None), "input_ids": [1.5, 2.0]},
        "input-ids-strings": {**_gen(text=None), "input_ids": ["a", "b"]},
        "input-ids-bools": {**_gen(text=None), "input_ids": [True, False]},
        "input-ids-negative": {**_gen(text=None), "input_ids": [1, -1, 2]},
        "input-ids-out-of-vocab": {**_gen(text=None), "input_ids": [1, FAR_OUT_OF_VOCAB]},
        "input-ids-empty": {**_gen(text=None), "input_ids": []},
        # well formed, but every server here runs its radix cache (a PD decode server without
        # one answered nothing through the router until disagg.request_guard refused it too)
        "input-embeds-with-radix-cache": {**_gen(text=None), "input_embeds": [[0.0] * 8]},
        "text-empty": _gen(text=""),  # no token after tokenization (SmolLM2 adds no BOS)
        "input-ids-too-long": {**_gen(text=None), "input_ids": [1] * TOO_LONG_TOKENS},
        "text-too-long": _gen(text="hello " * TOO_LONG_TOKENS),
        "sampling-params-not-object": _gen(sampling_params="greedy"),
        "sampling-params-empty-list": _gen(sampling_params=[]),  # one prompt: a 500 upstream
        "sampling-params-list-one-prompt": _gen(sampling_params=[{"max_new_tokens": 4}]),
        "sampling-params-unknown-key": _gen_sp(temprature=0.5),
        "max-new-tokens-negative": _gen_sp(max_new_tokens=-5),
        "max-new-tokens-absurd": _gen_sp(max_new_tokens=10**12),
        "max-new-tokens-string": _gen_sp(max_new_tokens="ten"),
        "max-new-tokens-float": _gen_sp(max_new_tokens=2.5),
        "temperature-negative": _gen_sp(temperature=-1.0),
        "temperature-string": _gen_sp(temperature="hot"),
        "top-k-above-int32": _gen_sp(top_k=2**31),  # killed the scheduler upstream
        "top-p-zero": _gen_sp(top_p=0.0),
        "top-p-above-one": _gen_sp(top_p=1.5),
        "min-p-above-one": _gen_sp(min_p=2.0),
        "repetition-penalty-negative": _gen_sp(repetition_penalty=-1.0),
        "n-zero-batch": {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 4, "n": 0}},
        "n-null": _gen_sp(n=None),  # a 500 upstream (None > 1)
        "n-mismatch-in-batch": {"text": ["a", "b"], "sampling_params": [
            {"max_new_tokens": 4, "n": 1}, {"max_new_tokens": 4, "n": 2}]},
        "stop-number": _gen_sp(stop=5),
        "stop-list-of-numbers": _gen_sp(stop=[1, 2]),
        "stop-token-ids-string": _gen_sp(stop_token_ids="2"),
        "stop-token-ids-strings": _gen_sp(stop_token_ids=["eos"]),
        # With min_new_tokens, an id outside the vocabulary killed the scheduler upstream.
        "stop-token-ids-outside-vocab": _gen_sp(min_new_tokens=1, stop_token_ids=[10**17]),
        "regex-invalid": _gen_sp(regex="(unclosed"),
        "json-schema-invalid": _gen_sp(json_schema="{not json"),
        "top-logprobs-absurd": _gen(return_logprob=True, top_logprobs_num=10**6),
        "logprob-start-len-string": _gen(return_logprob=True, logprob_start_len="zero"),
        "stream-not-bool": _gen(stream="yes"),
        "rid-list-one-prompt": _gen(rid=["r1"]),  # a 500 upstream (unhashable)
    }
    return items + [BadRequest(f"generate-{k}", g, _json(v)) for k, v in bodies.items()]


def _completions_items() -> list[BadRequest]:
    c = Endpoint.COMPLETIONS.value
    items = _envelope_items("completions", c, _cmpl())
    bodies: dict[str, dict] = {
        "no-prompt": {"max_tokens": 4},
        "prompt-not-string": _cmpl(prompt={"text": "hi"}),
        "prompt-number": _cmpl(prompt=3.5),
        "prompt-ids-floats": _cmpl(prompt=[1.5, 2.5]),
        "prompt-ids-negative": _cmpl(prompt=[1, -7]),
        "prompt-ids-out-of-vocab": _cmpl(prompt=[1, FAR_OUT_OF_VOCAB]),
        "prompt-too-long": _cmpl(prompt="hello " * TOO_LONG_TOKENS),
        "max-tokens-negative": _cmpl(max_tokens=-1),
        "max-tokens-absurd": _cmpl(max_tokens=10**12),
        "max-tokens-string": _cmpl(max_tokens="four"),
        "temperature-negative": _cmpl(temperature=-0.5),
        "top-p-zero": _cmpl(top_p=0),
        "top-p-above-one": _cmpl(top_p=2.0),
        "n-zero": _cmpl(n=0),
        "n-string": _cmpl(n="two"),
        "n-zero-batch": _cmpl(prompt=["a", "b"], n=0),  # a 500 upstream
        "stop-number": _cmpl(stop=7),
        "stop-token-ids-string": _cmpl(stop_token_ids="2"),
        "logprobs-absurd": _cmpl(logprobs=10**6),
        "echo-not-bool": _cmpl(echo="sometimes"),
        "rid-list-one-prompt": _cmpl(rid=["r1"]),
    }
    return items + [BadRequest(f"completions-{k}", c, _json(v)) for k, v in bodies.items()]


def _chat_items() -> list[BadRequest]:
    h = Endpoint.CHAT.value
    items = _envelope_items("chat", h, _chat())
    bodies: dict[str, dict] = {
        "no-messages": {"max_tokens": 4},
        "messages-not-list": _chat(messages="hello"),
        "messages-empty": _chat(messages=[]),
        "message-not-object": _chat(messages=["hello"]),
        "message-unknown-role": _chat(messages=[{"role": "wizard", "content": "hi"}]),
        "message-no-role": _chat(messages=[{"content": "hi"}]),
        "message-missing-content": _chat(messages=[{"role": "user"}]),
        "message-content-number": _chat(messages=[{"role": "user", "content": 42}]),
        "message-content-bad-part": _chat(messages=[{"role": "user", "content": [{"type": "hologram"}]}]),
        "message-too-long": _chat(messages=[{"role": "user", "content": "hello " * TOO_LONG_TOKENS}]),
        "max-tokens-negative": _chat(max_tokens=-3),
        "max-tokens-absurd": _chat(max_tokens=10**12),
        "max-completion-tokens-string": _chat(max_tokens=None, max_completion_tokens="many"),
        "temperature-negative": _chat(temperature=-2),
        "top-p-zero": _chat(top_p=0.0),
        "top-p-above-one": _chat(top_p=1.01),
        "top-k-above-int32": _chat(top_k=2**40),
        "n-zero": _chat(n=0),
        "stop-number": _chat(stop=3),
        "stop-token-ids-string": _chat(stop_token_ids="eos"),
        "stop-token-ids-outside-vocab": _chat(min_tokens=1, stop_token_ids=[-7]),
        "tools-not-list": _chat(tools="calculator"),
        "response-format-unknown": _chat(response_format={"type": "yaml"}),
        "response-format-not-object": _chat(response_format=[[]]),  # a 500 upstream
        "response-format-schema-not-object": _chat(response_format={"type": "json_schema", "schema": [1]}),
        "logit-bias-not-object": _chat(logit_bias=[1, 2]),
        "top-logprobs-absurd": _chat(logprobs=True, top_logprobs=10**6),
        "rid-list": _chat(rid=["r1"]),
    }
    return items + [BadRequest(f"chat-{k}", h, _json(v)) for k, v in bodies.items()]


# What each PD router answers itself for some catalogue items, by router kind (the values of
# disagg.router.RouterKind), with the status it gives; everything else must be a 4xx through
# the router too. Documented in docs/reliability.md ("Bad input"); the fuzz test asserts these
# answers are still what the router gives, and `hack bench soak` accepts them.
ROUTER_ANSWERS: dict[str, dict[str, int]] = {
    # The Rust router parses a request into its own typed struct and sends that on: an unknown
    # sampling_params key is dropped, and the servers see (and serve) a valid request.
    "rust": {"generate-sampling-params-unknown-key": 200,
             # It forwards a chat with a list rid, and a /generate whose sampling_params.n is
             # null, as requests the servers serve (200).
             "chat-rid-list": 200, "generate-n-null": 200},
    # SGLang's Python mini-lb fails on these in its own request handling before any server sees
    # them (sglang_router/mini_lb.py, _get_request_batch_size); not fixable on our side.
    "mini-lb": {
        "generate-text-not-string": 500,  # len(123): TypeError
        "generate-input-ids-empty": 500,  # input_ids[0]: IndexError
        "generate-stream-not-bool": 200,  # "yes" is truthy: its streaming path answers 200 first
    },
}


def router_answer(router: str | None, name: str) -> int | None:
    """The status router kind `router` gives catalogue item `name` itself, if it is one of those."""
    return ROUTER_ANSWERS.get(router or "", {}).get(name)


def bad_requests() -> list[BadRequest]:
    """The whole catalogue (names unique); every item must get a 4xx.

    Left out because SGLang 0.5.23 serves them (200) and they are not wrong enough to refuse:
    both `text` and `input_ids` (input_ids win), top_k 0, n 0 or negative on /generate (one
    sample), more sampling_params than prompts, negative logprobs counts (none returned)."""
    out = _generate_items() + _completions_items() + _chat_items()
    names = [r.name for r in out]
    if len(set(names)) != len(names):  # a programming error in this file, caught by its unit test
        raise AssertionError("duplicate names in the malformed-request catalogue")
    return out


def send(base_url: str, req: BadRequest, timeout: float = 60.0) -> int:
    """POST `req` to base_url + req.path; the HTTP status, 0 when the connection failed or
    timed out."""
    headers = {"Content-Type": req.content_type} if req.content_type else {}
    try:
        r = requests.post(base_url.rstrip("/") + req.path, data=req.body, headers=headers, timeout=timeout)
    except requests.RequestException:
        return 0
    return int(r.status_code)
