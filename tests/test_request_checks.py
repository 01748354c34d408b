"""The request checks the plugin adds in SGLang's tokenizer manager (engine.request_checks), and
their hook (engine.hooks), without a server: each value a fuzz or catalogue run found crashing
the scheduler is refused with a ValueError (SGLang answers it with HTTP 400), and the values
around it still pass."""
from __future__ import annotations

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
