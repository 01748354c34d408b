"""The request checks the plugin adds in SGLang's tokenizer manager (engine.request_checks), and
their hook (engine.hooks), without a server: each value a fuzz or catalogue run found crashing
the scheduler is refused with a ValueError (SGLang answers it with HTTP 400), and the values
around it still pass."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from engine.hooks import _before_validate_one_request
from engine.request_checks import check_input_ids, check_top_logprobs_num

VOCAB = 49152


def test_input_ids_inside_the_vocabulary_pass():
    check_input_ids(VOCAB, None)
    check_input_ids(VOCAB, [0, 1, VOCAB - 1])


@pytest.mark.parametrize("ids, words", [
    ([1, -1], "outside the vocabulary"),
    ([VOCAB], "outside the vocabulary"),
    ([1 << 40], "outside the vocabulary"),
    ([1.5], "must be integers"),
    ([True], "must be integers"),
    ("1 2", "list of integers"),
    ([], "the prompt is empty"),
])
def test_input_ids_refused(ids, words):
    with pytest.raises(ValueError, match=words):
        check_input_ids(VOCAB, ids)


@pytest.mark.parametrize("k", [None, 0, 1, 20, VOCAB, -1, [0, 5], [VOCAB, 1]])
def test_top_logprobs_up_to_the_vocabulary_pass(k):
    check_top_logprobs_num(VOCAB, k)  # negative means none upstream


@pytest.mark.parametrize("k", [VOCAB + 1, 10**6, [1, 10**6]])
def test_top_logprobs_above_the_vocabulary_refused(k):
    with pytest.raises(ValueError, match="at most the vocabulary size 49152"):
        check_top_logprobs_num(VOCAB, k)


def test_the_hook_applies_both_checks():
    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB))
    _before_validate_one_request(manager, SimpleNamespace(top_logprobs_num=5), [1, 2])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _before_validate_one_request(manager, SimpleNamespace(top_logprobs_num=0), [VOCAB])
    with pytest.raises(ValueError, match="top_logprobs_num"):
        _before_validate_one_request(manager, SimpleNamespace(top_logprobs_num=10**6), [1])


@pytest.mark.parametrize("fields, words", [
    ({"lora_id": [None, "a"]}, "lora_id is \\[None, 'a'\\]; it must be a string"),
    ({"lora_id": 3}, "lora_id is 3"),
    ({"return_hidden_states": "x"}, "return_hidden_states must be a boolean or the string literal 'last'"),
    ({"return_hidden_states": [True]}, "return_hidden_states must be"),
    ({"sampling_params": {"min_new_tokens": 1, "stop_token_ids": [10**17]}}, r"stop_token_ids holds 10+, outside"),
    ({"sampling_params": {"stop_token_ids": [5, -7]}}, r"stop_token_ids holds -7, outside the vocabulary \[0, 49152\)"),
    ({"sampling_params": {"stop_token_ids": [VOCAB]}}, "stop_token_ids holds 49152"),
    ({"sampling_params": {"top_k": 2**31}}, "top_k is 2147483648; at most 2147483647"),
    ({"sampling_params": {"max_new_tokens": None, "min_new_tokens": 2**40}}, "min_new_tokens is 1099511627776"),
])
def test_the_hook_refuses_fields_that_killed_the_scheduler(fields, words):
    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB))
    with pytest.raises(ValueError, match=words):
        _before_validate_one_request(manager, SimpleNamespace(top_logprobs_num=0, **fields), [1])


@pytest.mark.parametrize("fields", [{"lora_id": "adapter-1"}, {"lora_id": None}, {"return_hidden_states": "last"},
                                    {"return_hidden_states": True}, {},
                                    {"sampling_params": {"min_new_tokens": 1, "stop_token_ids": [0, VOCAB - 1]}},
                                    {"sampling_params": {"stop_token_ids": None}}, {"sampling_params": None},
                                    {"sampling_params": {"top_k": 2**31 - 1}}, {"sampling_params": {"top_k": -1}}])
def test_the_hook_passes_what_the_scheduler_reads(fields):
    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB))
    _before_validate_one_request(manager, SimpleNamespace(top_logprobs_num=0, **fields), [1])


# ---------------------------------------------------------------- the JSON-object guard (HTTP)

@pytest.mark.parametrize("body, refused", [
    (b'{"messages": []}', False),
    (b'  \n{"text": "hi"}', False),
    (b"", False),  # SGLang answers an empty body with its own 400
    (b"{not json", False),  # SGLang answers invalid JSON with its own 400
    (b"[]", True),
    (b"[1, 2]", True),
    (b'"hello"', True),
    (b"null", True),
    (b" 42", True),
])
def test_body_shape(body, refused):
    from engine.request_checks import body_shape_error

    assert (body_shape_error(body) is not None) == refused


def _drive(path: str, chunks: list[bytes], method: str = "POST") -> tuple[list[dict], list[bytes] | None]:
    """Run the guard over a fake app; returns what was sent and the body the app read (None:
    the app was not called)."""
    import asyncio

    from engine.http_guard import JsonObjectGuard

    seen: dict = {}

    async def app(scope, receive, send):
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        seen["body"] = body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path}
    asyncio.run(JsonObjectGuard(app)(scope, receive, send))
    return sent, seen.get("body")


def test_guard_refuses_a_non_object_body_with_sglangs_error_shape():
    import json

    sent, body = _drive("/v1/chat/completions", [b"[", b"1]"])
    assert body is None
    assert sent[0]["status"] == 400
    err = json.loads(sent[1]["body"])
    assert err["code"] == 400 and "JSON object" in err["message"]


def test_guard_replays_an_object_body_in_one_piece():
    sent, body = _drive("/generate", [b'{"text": ', b'"hi"}'])
    assert body == b'{"text": "hi"}' and sent[0]["status"] == 200


@pytest.mark.parametrize("path, method", [("/health", "POST"), ("/generate", "GET"), ("/v1/models", "POST")])
def test_guard_leaves_other_requests_alone(path, method):
    sent, body = _drive(path, [b"[1]"], method=method)
    assert body == b"[1]" and sent[0]["status"] == 200


def test_guard_installs_once():
    from fastapi import FastAPI

    from engine.http_guard import install

    app = FastAPI()
    assert install(app) is True
    assert install(app) is False


# ---------------------------------------------------------------- field checks (HTTP, found by schema fuzzing)

def _field_error(path: str, body: dict | bytes) -> str | None:
    import json

    from engine.request_checks import body_field_error

    return body_field_error(path, body if isinstance(body, bytes) else json.dumps(body).encode())


@pytest.mark.parametrize("embeds, words", [
    ([], "input_embeds must be a non-empty list"),
    ([[]], r"input_embeds\[0\] must be a non-empty list of floats"),
    ([[1.0], [1.0, 2.0]], r"input_embeds\[1\] has 2 values and input_embeds\[0\] has 1"),
    ([[1.0, "a"]], r"input_embeds\[0\] holds 'a'"),
    ([[1.0, True]], r"input_embeds\[0\] holds True"),
    ([[1, 2.0]], r"input_embeds\[0\]\[0\] is 1, not a float"),
    ([1.0], r"input_embeds\[0\] must be a non-empty list"),
    ([[[1.0]], [[1.0], [2.0, 3.0]]], r"input_embeds\[1\]\[1\] has 2 values"),
    ([[[1.0]], []], r"input_embeds\[1\] must be a non-empty list of token embeddings"),
    ("x", "input_embeds must be a non-empty list"),
])
def test_input_embeds_that_sglang_cannot_read_are_refused_naming_the_field(embeds, words):

    error = _field_error("/generate", {"input_embeds": embeds})
    assert error is not None and re.search(words, error), error


@pytest.mark.parametrize("body", [
    {"input_embeds": [[0.5, 1.0], [0.25, -1.0]]},  # one prompt, two tokens
    {"input_embeds": [[[0.5]], [[1.5], [2.5]]]},  # a batch of two prompts
    {"text": "hi", "input_embeds": []},  # SGLang ignores input_embeds beside text
    {"input_ids": [1, 2], "input_embeds": [[]]},  # and beside input_ids
    {"text": ["a", "b"], "bootstrap_port": [1, 2]},
    {"text": ["a"], "sampling_params": [{}, {}]},  # longer than the batch: SGLang reads the first ones
    {"text": "a", "bootstrap_port": []},  # one prompt: no per-prompt lists
    {"text": ["a", "b"], "token_ids_logprob": [1, 2]},  # one list of ids for every prompt
])
def test_generate_bodies_sglang_serves_pass(body):
    assert _field_error("/generate", body) is None


@pytest.mark.parametrize("body, field", [
    ({"text": ["a", "b"], "bootstrap_port": []}, "bootstrap_port"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [[1], [2], [3]], "lora_path": ["x"]}, "lora_path"),
    ({"text": ["a", "b"], "return_logprob": [True]}, "return_logprob"),
    ({"text": ["a", "b"], "token_ids_logprob": [[1]]}, "token_ids_logprob"),
    ({"input_embeds": [[[1.0]], [[2.0]]], "bootstrap_room": [1]}, "bootstrap_room"),
])
def test_a_per_prompt_list_shorter_than_the_batch_is_refused(body, field):
    error = _field_error("/generate", body)
    assert error is not None and error.startswith(f"{field} has ") and "for a batch of" in error


@pytest.mark.parametrize("body", [
    {"input_ids": [255, 34, 694], "sampling_params": []},  # IndexError in SGLang: a 500
    {"input_ids": [1, 2], "sampling_params": [{}]},  # AttributeError in SGLang: a 500
    {"text": "a", "sampling_params": [{}, {}]},
    {"input_embeds": [[0.5]], "sampling_params": [{"max_new_tokens": 1}]},
])
def test_one_prompt_with_a_list_of_sampling_params_is_refused(body):
    error = _field_error("/generate", body)
    assert error is not None and error.startswith("sampling_params is a list, but the request has one prompt")


def test_sampling_params_lists_pass_for_a_batch_and_without_a_prompt():
    assert _field_error("/generate", {"input_ids": [[1], [2]], "sampling_params": [{}, {}]}) is None
    assert _field_error("/generate", {"text": "a", "sampling_params": {}}) is None
    assert _field_error("/generate", {"sampling_params": []}) is None  # SGLang: no prompt given


_CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/invocations"])
@pytest.mark.parametrize("fmt, words", [
    ([[]], "response_format is list"),
    ("json", "response_format is str"),
    ({"type": "json_schema", "schema": [1]}, "response_format.schema is list"),
    ({"type": "json_schema", "schema": {"properties": []}}, "schema.properties must be an object"),
    ({"type": "json_schema", "schema": {"properties": {"strict": 1}}}, "properties.strict must be an object"),
])
def test_a_chat_response_format_sglang_reads_as_an_object_must_be_one(path, fmt, words):
    error = _field_error(path, {**_CHAT, "response_format": fmt})
    assert error is not None and words in error, error


@pytest.mark.parametrize("fmt", [
    None, {}, [], {"type": "text"}, {"type": "json_object"},
    {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}, "schema": 5},  # schema unused
    {"type": "text", "schema": 5},  # read only for json_schema
])
def test_chat_response_formats_sglang_reads_pass(fmt):
    assert _field_error("/v1/chat/completions", {**_CHAT, "response_format": fmt}) is None


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "hi", "rid": ["a"]}),
    ("/generate", {"input_ids": [1, 2], "rid": [], "sampling_params": {"n": 1}}),
    ("/v1/completions", {"prompt": "hi", "rid": ["b"]}),
    ("/v1/completions", {"prompt": [1, 2], "rid": ["b"], "n": 1}),
    ("/v1/chat/completions", {**_CHAT, "rid": ["c"]}),
    ("/v1/chat/completions", {**_CHAT, "rid": [], "n": "2"}),
    ("/invocations", {**_CHAT, "rid": ["d"]}),
])
def test_a_list_rid_for_one_prompt_sampled_once_is_refused(path, body):
    error = _field_error(path, body)
    assert error is not None and error.startswith("rid is a list, but the request has one prompt"), error


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "hi", "rid": "a"}),
    ("/generate", {"text": "hi", "rid": ["a"], "sampling_params": {"n": 2}}),  # SGLang serves it
    ("/generate", {"text": ["hi", "yo"], "rid": ["a", "b"]}),
    ("/generate", {"rid": ["a"]}),  # no prompt: SGLang's own 400
    ("/v1/completions", {"prompt": ["hi", "yo"], "rid": ["a", "b"]}),
    ("/v1/completions", {"prompt": "hi", "rid": ["a"], "n": 2}),
    ("/v1/chat/completions", {**_CHAT, "rid": ["a"], "n": 2}),
])
def test_rid_lists_sglang_serves_pass(path, body):
    assert _field_error(path, body) is None


@pytest.mark.parametrize("path, body, words", [
    ("/v1/completions", {"prompt": ["a", "b"], "n": 0}, "n is 0; at least 1"),
    ("/v1/completions", {"prompt": "a", "n": -2}, "n is -2"),
    ("/v1/chat/completions", {**_CHAT, "n": 0}, "n is 0"),
    ("/generate", {"text": ["a", "b"], "sampling_params": {"n": 0}}, "sampling_params.n is 0"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 0}]}, r"sampling_params\[1\].n is 0"),
    ("/generate", {"input_ids": [210, 93], "sampling_params": {"n": None}}, "sampling_params.n is null"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": None}, {}]}, r"sampling_params\[0\].n is null"),
])
def test_fewer_than_one_sample_per_prompt_is_refused(path, body, words):
    error = _field_error(path, body)
    assert error is not None and re.search(words, error), error


def test_one_or_more_samples_pass():
    assert _field_error("/v1/completions", {"prompt": ["a", "b"], "n": 2}) is None
    assert _field_error("/generate", {"text": "a", "sampling_params": {"n": 1}}) is None
    assert _field_error("/v1/completions", {"prompt": "a", "n": "two"}) is None  # SGLang's own 400


@pytest.mark.parametrize("tools, refused", [
    ([{"type": [None, None], "name": "bash"}], "tools[0].type is list"),
    ([{"name": "f", "input_schema": {}}, {"type": 5}], "tools[1].type is int"),
    ([{"type": "bash_20250124", "name": "bash"}], None),
    ([{"type": None, "name": "f", "input_schema": {}}], None),  # absent type: a custom tool
    ("not a list", None),  # SGLang's request model refuses it
])
def test_an_anthropic_tool_type_must_be_a_string(tools, refused):
    error = _field_error("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [], "tools": tools})
    if refused is None:
        assert error is None, error
    else:
        assert error is not None and refused in error, error


def test_completion_batches_need_a_bootstrap_entry_per_prompt():
    assert "bootstrap_port has 0 entries for a batch of 2" in _field_error(
        "/v1/completions", {"prompt": [[1, 2], [3]], "bootstrap_port": []})
    assert _field_error("/v1/completions", {"prompt": [1, 2], "bootstrap_port": []}) is None  # one prompt
    assert _field_error("/v1/completions", {"prompt": ["a", "b"], "bootstrap_port": [1, 2]}) is None


@pytest.mark.parametrize("body, words", [
    ({"instances": [{"text": "a"}], "parameters": {"unknown_field": 1}}, "parameters.unknown_field is not a field"),
    ({"instances": [{"text": "a"}], "parameters": {"text": "b"}}, "the instances already give text"),
    ({"instances": [{"text": "a"}], "parameters": {"image_data": "x"}}, "images belong in the instances"),
    ({"instances": [1]}, r"instances\[0\] is int"),
    ({"instances": [{"text": "a"}, {}]}, r"instances\[1\] has no text"),
    ({"instances": [{"input_embeds": [[1.0]]}, {"input_embeds": [[]]}]}, r"instances\[1\].input_embeds\[0\]"),
    ({"instances": [{}], "parameters": {"input_embeds": [[], []]}}, r"input_embeds\[0\] must be"),
    ({"instances": [{"text": "a"}, {"text": "b"}], "parameters": {"bootstrap_host": ["h"]}}, "bootstrap_host has 1"),
    ({"instances": [{}], "parameters": {"text": 5}}, "the /generate request .*integer `5`"),
    ({"instances": [{}], "parameters": {"input_ids": 5}}, "integer `5`"),
    ({"instances": [{"text": 5}]}, "expected a string"),
    ({"instances": [{"text": "a"}, {"text": 5}]}, "expected a string"),
])
def test_vertex_requests_sglang_cannot_build_are_refused(body, words):
    error = _field_error("/vertex_generate", body)
    assert error is not None and re.search(words, error), error


@pytest.mark.parametrize("body", [
    {"instances": [{"text": "a"}, {"text": "b"}], "parameters": {"sampling_params": {"max_new_tokens": 2}}},
    {"instances": []},  # SGLang answers []
    {"instances": [{}], "parameters": {"text": "a"}},  # the parameters alone are the request
    {"instances": [{"input_ids": [1, 2]}, {"input_ids": [3]}], "parameters": {"sampling_params": {"n": 2}}},
    {"instances": [{"input_embeds": [[1.0]]}]},
])
def test_vertex_requests_sglang_serves_pass(body):
    assert _field_error("/vertex_generate", body) is None


@pytest.mark.parametrize("path, body, words", [
    ("/api/chat", {"model": "m", "messages": []}, "messages is empty"),
    ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                   "options": {"num_predict": "1"}}, "options.num_predict is '1'; it must be an integer"),
    ("/api/generate", {"model": "m", "prompt": "x", "options": {"num_predict": [-1]}}, "options.num_predict"),
    ("/api/generate", {"model": "m", "prompt": "x", "options": {"temperature": "hot"}}, "options.temperature"),
    ("/api/generate", {"model": "m", "prompt": "x", "options": {"stop": [1]}}, "options.stop"),
])
def test_ollama_fields_of_the_wrong_kind_are_refused(path, body, words):
    error = _field_error(path, body)
    assert error is not None and words in error, error


def test_ollama_values_sglang_checks_itself_pass_here():
    # A negative num_predict is SGLang's own ValueError (engine.ollama_errors answers it).
    assert _field_error("/api/generate", {"model": "m", "prompt": "x",
                                          "options": {"num_predict": -1, "temperature": 0.5, "stop": "a"}}) is None


@pytest.mark.parametrize("body", [b"{not json", b"[1]", b"", b'{"input_embeds": [[NaN]]}'])
def test_field_checks_leave_what_is_not_an_object_to_sglang(body):
    assert _field_error("/generate", body) is None
    assert _field_error("/health", b'{"input_embeds": []}') is None  # not a generation path


def test_guard_refuses_a_bad_field_naming_it():
    import json

    sent, body = _drive("/generate", [b'{"input_embeds": []}'])
    assert body is None and sent[0]["status"] == 400
    assert "input_embeds" in json.loads(sent[1]["body"])["message"]


# ---------------------------------------------------------------- Ollama's errors and the abort task

def _run(coro):
    import asyncio

    return asyncio.run(coro)


async def _read(response) -> bytes:
    out = b""
    async for chunk in response.body_iterator:
        out += chunk
    return out


def test_ollama_value_errors_are_400_with_ollamas_error_body():
    import json

    from engine.ollama_errors import answer_errors

    async def refuses(self, request, raw):
        raise ValueError("max_new_tokens must be at least 0, got -1.")

    r = _run(answer_errors(refuses, None, None, None))
    assert r.status_code == 400 and json.loads(r.body) == {"error": "max_new_tokens must be at least 0, got -1."}


def test_an_ollama_stream_refused_at_its_first_chunk_is_a_400():
    from fastapi.responses import StreamingResponse

    from engine.ollama_errors import answer_errors

    async def chunks():
        raise ValueError("Cannot apply chat template to an empty conversation.")
        yield b""  # noqa: unreachable - makes this an async generator

    async def streams(self, request, raw):
        return StreamingResponse(chunks(), media_type="application/x-ndjson")

    r = _run(answer_errors(streams, None, None, None))
    assert r.status_code == 400 and b"empty conversation" in r.body


def test_an_ollama_stream_that_fails_later_ends_with_an_error_line():
    import json

    from fastapi.responses import StreamingResponse

    from engine.ollama_errors import answer_errors

    async def chunks():
        yield b'{"done": false}\n'
        raise RuntimeError("scheduler went away")

    async def streams(self, request, raw):
        return StreamingResponse(chunks(), media_type="application/x-ndjson")

    async def go():
        r = await answer_errors(streams, None, None, None)
        return r, await _read(r)

    r, body = _run(go())
    lines = body.splitlines()
    assert r.status_code == 200 and lines[0] == b'{"done": false}'
    assert json.loads(lines[1]) == {"error": "scheduler went away"}


def test_an_ollama_stream_that_works_is_passed_through_whole():
    from fastapi.responses import StreamingResponse

    from engine.ollama_errors import answer_errors

    async def chunks():
        for i in range(3):
            yield f"{i}\n".encode()

    async def streams(self, request, raw):
        return StreamingResponse(chunks(), media_type="application/x-ndjson")

    async def go():
        r = await answer_errors(streams, None, None, None)
        return await _read(r)

    assert _run(go()) == b"0\n1\n2\n"


def test_the_abort_task_skips_a_request_that_was_never_read():
    from types import SimpleNamespace

    from engine.stream_abort import skip_unread

    aborted = []

    def upstream_task(manager, obj):
        async def task():
            aborted.append(obj.is_single)  # upstream reads it: AttributeError when unread
        return task

    unread, read = SimpleNamespace(), SimpleNamespace(is_single=True)
    _run(skip_unread(upstream_task, None, unread)())
    assert aborted == []
    _run(skip_unread(upstream_task, None, read)())
    assert aborted == [True]


def test_the_hook_refuses_input_embeds_not_as_wide_as_the_hidden_size():
    """A server launched with --disable-radix-cache takes input_embeds; a row narrower than the
    hidden size killed its scheduler in the first layer norm (SmolLM2, 576 wide, given 8)."""
    import torch

    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB, hidden_size=576))
    _before_validate_one_request(manager, SimpleNamespace(top_logprobs_num=0, input_embeds=[[0.0] * 576] * 3), None)
    _before_validate_one_request(manager, SimpleNamespace(top_logprobs_num=0, input_embeds=torch.zeros(3, 576)), None)
    for embeds, words in (([[0.0] * 576, [0.0] * 8], r"input_embeds\[1\] has 8 values; this model's embeddings have 576"),
                          ([[0.0] * 577], r"input_embeds\[0\] has 577 values"),
                          (torch.zeros(2, 64), "input_embeds rows have 64 values")):
        with pytest.raises(ValueError, match=words):
            _before_validate_one_request(manager, SimpleNamespace(top_logprobs_num=0, input_embeds=embeds), None)
