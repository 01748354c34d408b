"""The malformed-request catalogue and the fuzz strategies, without a server: the catalogue
covers what it promises, `send` reports statuses and failures as documented, and the strategies
keep every body that might be valid cheap."""
from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from hypothesis import given, settings

from disagg.fuzz_bodies import SMALL_BUDGET, request_bodies
from disagg.malformed import TOO_LONG_TOKENS, BadRequest, Endpoint, bad_requests, send
from engine.launcher import free_port

# Kinds of bad input the catalogue must hold (issue 16): a name fragment each, per endpoint.
REQUIRED = {
    "generate": ("invalid-json", "empty-body", "json-array", "text-not-string", "input-ids-floats",
                 "input-ids-out-of-vocab", "input-ids-negative", "sampling-params-not-object",
                 "max-new-tokens-negative", "max-new-tokens-absurd", "temperature-negative",
                 "top-p-zero", "top-p-above-one", "input-ids-too-long", "n-", "stop-number",
                 "stop-token-ids-string", "wrong-content-type"),
    "completions": ("invalid-json", "empty-body", "prompt-not-string", "max-tokens-negative",
                    "max-tokens-absurd", "temperature-negative", "top-p-zero", "top-p-above-one",
                    "prompt-ids-out-of-vocab", "prompt-too-long", "n-", "stop-number", "wrong-content-type"),
    "chat": ("invalid-json", "empty-body", "messages-not-list", "message-unknown-role",
             "message-missing-content", "max-tokens-negative", "max-tokens-absurd",
             "temperature-negative", "top-p-zero", "top-p-above-one", "message-too-long", "n-",
             "stop-number", "stop-token-ids-string", "wrong-content-type"),
}


def test_catalogue_names_paths_and_coverage():
    items = bad_requests()
    names = [r.name for r in items]
    assert len(names) == len(set(names))
    assert {r.path for r in items} == {e.value for e in Endpoint}
    for prefix, kinds in REQUIRED.items():
        mine = [n for n in names if n.startswith(prefix + "-")]
        for kind in kinds:
            assert any(kind in n for n in mine), f"no {prefix} item for {kind!r}"
    assert all(isinstance(r.body, bytes) for r in items)


def test_catalogue_bodies_are_what_they_say():
    for r in bad_requests():
        if r.name.endswith(("-invalid-json", "-empty-body", "-not-utf8")):
            with pytest.raises(ValueError):
                json.loads(r.body)
            continue
        body = json.loads(r.body)
        if r.name.endswith("-wrong-content-type"):
            assert r.content_type != "application/json" and isinstance(body, dict)
        elif r.name.endswith("-too-long"):
            assert len(r.body) > TOO_LONG_TOKENS  # one token at least per repeated word or id


class _Echo(BaseHTTPRequestHandler):
    seen: list[tuple[str, str, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        n = int(self.headers.get("Content-Length", 0))
        _Echo.seen.append((self.path, self.headers.get("Content-Type", ""), self.rfile.read(n)))
        self.send_response(418)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_send_reports_the_status_and_sends_exactly_the_body():
    srv = HTTPServer(("127.0.0.1", 0), _Echo)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        req = BadRequest("x", Endpoint.CHAT.value, b'{"a": NaN', content_type="text/plain")
        assert send(f"http://127.0.0.1:{srv.server_port}/", req, timeout=10) == 418
        assert _Echo.seen[-1] == ("/v1/chat/completions", "text/plain", b'{"a": NaN')
    finally:
        srv.shutdown()
        srv.server_close()


def test_send_reads_zero_when_nothing_answers():
    req = BadRequest("x", Endpoint.GENERATE.value, b"{}")
    assert send(f"http://127.0.0.1:{free_port()}", req, timeout=5) == 0


def _costly(value) -> bool:
    """A count a lenient parser would accept and that is larger than the cheap limit."""
    if isinstance(value, bool):
        return False
    try:
        x = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(x) and SMALL_BUDGET < x < 10**7


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_strategies_keep_valid_bodies_cheap(endpoint):
    seen = {"dict": 0}

    @settings(max_examples=300, derandomize=True, database=None, deadline=None)
    @given(request_bodies(endpoint))
    def check(raw: bytes) -> None:
        body = json.loads(raw)
        if not isinstance(body, dict):
            return
        seen["dict"] += 1
        if endpoint is Endpoint.GENERATE:
            sps = body.get("sampling_params")
            for sp in (sps if isinstance(sps, list) else [sps]):
                if isinstance(sp, dict):
                    assert sp.get("max_new_tokens") is not None, body
                    assert not _costly(sp["max_new_tokens"]), body
                    assert not (_costly(sp.get("n")) and float(sp["n"]) > 4), body
        else:
            budget = body.get("max_tokens", body.get("max_completion_tokens"))
            assert budget is not None or body.get("max_completion_tokens") is not None, body
            assert not _costly(body.get("max_tokens")) and not _costly(body.get("max_completion_tokens")), body
            for key in ("n", "best_of"):
                assert not (_costly(body.get(key)) and float(body[key]) > 4), body

    check()
    assert seen["dict"] > 100  # most bodies are objects: the near-valid family is
