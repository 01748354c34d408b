"""`hack bench disagg` empties the servers' radix caches between points: a server still
settling after the last request refuses for a while, which is waited out, not a failed method."""
from __future__ import annotations

import http.server
import threading

import pytest

from disagg import bench

BUSY = "Cache not flushed because there are pending requests. #queue-req: 0, #running-req: 0"


class _Server(http.server.ThreadingHTTPServer):
    def __init__(self, answers: list[tuple[int, str]]) -> None:
        self.answers, self.calls = list(answers), 0
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        srv = self.server
        srv.calls += 1
        code, text = srv.answers.pop(0) if len(srv.answers) > 1 else srv.answers[0]
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def servers():
    made = []

    def make(answers):
        s = _Server(answers)
        made.append(s)
        return s

    yield make
    for s in made:
        s.shutdown()
        s.server_close()


def test_a_busy_server_is_waited_out_and_the_router_is_not_asked(servers):
    prefill = servers([(400, BUSY), (400, BUSY), (200, "ok")])
    decode = servers([(200, "ok")])
    router = servers([(206, "partial")])
    slept = []
    state = {"servers": [{"role": "prefill", "url": prefill.url}, {"role": "decode", "url": decode.url},
                         {"role": "router", "url": router.url}]}
    assert bench.flush_caches(state, sleep=slept.append) == 2
    assert (prefill.calls, decode.calls, router.calls) == (3, 1, 0)
    assert slept == [0.5, 1.0]   # backoff


def test_a_server_busy_past_the_deadline_or_refusing_otherwise_is_an_error(servers):
    busy = servers([(400, BUSY)])
    state = {"servers": [{"role": "prefill", "url": busy.url}]}
    with pytest.raises(RuntimeError, match=r"still busy after .*pending requests"):
        bench.flush_caches(state, deadline_s=2.0, sleep=lambda s: None)
    assert busy.calls >= 2
    broken = servers([(500, "Internal Server Error")])
    with pytest.raises(RuntimeError, match="flush_cache refused after 0 s: 500"):
        bench.flush_caches({"servers": [{"role": "decode", "url": broken.url}]}, sleep=lambda s: None)
    assert broken.calls == 1
