"""The Rust router `hack up` starts (disagg/router.py), in front of stand-in servers that answer
like SGLang's HTTP API, with a server killed: a request routed to it while it is still in
rotation is retried until a live server serves it. No model is loaded; the router's own
behaviour under our settings, in seconds (the soak in tests/test_soak_e2e.py does the same on
real servers)."""
from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from disagg.router import RouterOptions, router_command, wait_ready


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandIn:
    """An HTTP server with SGLang's endpoints the router calls: /health, /server_info,
    /model_info and /generate (JSON, or server-sent events when the body asks to stream)."""

    def __init__(self, name: str, port: int | None = None) -> None:
        self.name, self.port = name, port or _free_port()
        self.generated = 0
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "StandIn":
        owner = self

        class Handler(BaseHTTPRequestHandler):
            # one request per connection: a killed server keeps no pooled connection open
            protocol_version = "HTTP/1.0"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, body: bytes, content_type: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                info = {"model_path": "stand-in", "served_model_name": "stand-in",
                        "is_generation": True}
                self._answer(json.dumps(info).encode(), "application/json")

            def do_POST(self) -> None:  # noqa: N802
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                owner.generated += 1
                out = {"text": owner.name, "meta_info": {"id": "r", "finish_reason": {"type": "length"}}}
                if request.get("stream"):
                    self._answer(f"data: {json.dumps(out)}\n\ndata: [DONE]\n\n".encode(),
                                 "text/event-stream")
                else:
                    self._answer(json.dumps(out).encode(), "application/json")

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def kill(self) -> None:
        """Stop answering: the port refuses connections, as after kill -9."""
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()
        self._server = None


@pytest.fixture
def router(tmp_path: Path) -> Iterator:
    procs: list[subprocess.Popen] = []

    def start(prefill: list[StandIn], decode: list[StandIn], options: RouterOptions) -> str:
        port = _free_port()
        cmd = router_command(port, [(p.url, _free_port()) for p in prefill], [d.url for d in decode],
                             options, prometheus_port=_free_port())
        log = open(tmp_path / f"router-{len(procs)}.log", "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, len(prefill) + len(decode), 60, lambda: proc.poll() is None)
        return url

    yield start
    for proc in procs:  # by pid: the router renames its process to "sglang::router"
        proc.kill()
        proc.wait(10)


def _generate(router_url: str, text: str, stream: bool = False) -> tuple[int, str]:
    body = json.dumps({"text": text, "stream": stream, "sampling_params": {"max_new_tokens": 4}})
    req = urllib.request.Request(router_url + "/generate", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


# Health checks once a minute: the dead server stays in rotation for the whole test, the worst
# case of the detection window that the retries must outlast.
SLOW_DETECTION = dict(health_check_interval_s=60)


def test_retries_reach_a_prefill_that_is_back_after_four_seconds(router) -> None:
    prefill, decode = StandIn("prefill").start(), StandIn("decode").start()
    url = router([prefill], [decode], RouterOptions(**SLOW_DETECTION))
    assert _generate(url, "warm")[0] == 200
    prefill.kill()
    threading.Timer(4.0, StandIn("prefill", prefill.port).start).start()
    t0 = time.time()
    status, body = _generate(url, "while the prefill is down")
    assert status == 200, body
    assert time.time() - t0 >= 4.0 and "decode" in body


def test_upstreams_quick_retries_give_up_within_the_detection_window(router) -> None:
    """The contrast: three attempts 50 and 100 ms apart (upstream's pace) all reach the dead
    prefill, and the client gets the 502 that CI's 2P1D soak saw."""
    prefill, decode = StandIn("prefill").start(), StandIn("decode").start()
    url = router([prefill], [decode], RouterOptions(retries=2, retry_backoff_ms=50, **SLOW_DETECTION))
    prefill.kill()
    t0 = time.time()
    status, body = _generate(url, "while the prefill is down")
    assert status == 502 and "prefill_server_error" in body
    assert time.time() - t0 < 4.0


def test_streamed_requests_routed_to_a_dead_decode_are_served_by_the_live_one(router) -> None:
    prefill = StandIn("prefill").start()
    live, dead = StandIn("decode-0").start(), StandIn("decode-1").start()
    url = router([prefill], [live, dead], RouterOptions(decode_policy="round_robin", **SLOW_DETECTION))
    dead.kill()
    answers = [_generate(url, f"request {i}", stream=True) for i in range(6)]
    assert [status for status, _ in answers] == [200] * 6
    assert all('"text": "decode-0"' in body and "[DONE]" in body for _, body in answers)
