"""`hack bench serve --decode-batch N`: N streams on one server at once, and the decode rate of
the window where all of them decode (engine.launcher.SGLangServer.timed_streams)."""
from __future__ import annotations

import http.server
import json
import threading
import time

import pytest
import requests

from engine.launcher import SGLangServer, batch_decode_rate


def test_the_window_runs_from_the_last_first_token_to_the_first_last_token():
    # stream a: tokens 1..5 at t = 0..4; stream b: tokens 1..4 at t = 1..4 (its first token last)
    a = [(float(t), t + 1) for t in range(5)]
    b = [(float(t), t) for t in range(1, 5)]
    got = batch_decode_rate([a, b])
    # window [1, 4]: a received 5 - 2 = 3 tokens in it, b 4 - 1 = 3
    assert got == {"batch": 2, "decode_tok_s": 2.0, "window_s": 3.0}


def test_streams_that_never_decode_together_have_no_rate():
    got = batch_decode_rate([[(0.0, 1), (1.0, 2)], [(2.0, 1), (3.0, 2)]])
    assert got["decode_tok_s"] is None and "never ran together" in got["why"]


class _StreamingServer(http.server.ThreadingHTTPServer):
    """Answers /generate with server-sent events as SGLang does: one chunk per token, `gap_s`
    apart, then [DONE]; the k-th request waits `first_s[k]` before its first token. With
    `together` = N, no request sends a token before N have arrived, as a real server batches
    them: the streams overlap however late a loaded host starts the client's threads."""

    def __init__(self, first_s: list[float], gap_s: float, together: int = 1) -> None:
        self.first_s, self.gap_s, self.seen = list(first_s), gap_s, 0
        self.lock = threading.Lock()
        self.arrived = threading.Barrier(together, timeout=60)
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            wait = srv.first_s[srv.seen % len(srv.first_s)]
            srv.seen += 1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        srv.arrived.wait()
        time.sleep(wait)
        for n in range(1, body["sampling_params"]["max_new_tokens"] + 1):
            self.wfile.write(f"data: {json.dumps({'meta_info': {'completion_tokens': n}})}\n\n".encode())
            self.wfile.flush()
            time.sleep(srv.gap_s)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def streaming():
    made = []

    def make(first_s: list[float], gap_s: float, together: int = 1) -> SGLangServer:
        srv = _StreamingServer(first_s, gap_s, together)
        made.append(srv)
        return SGLangServer("unused", port=srv.server_address[1])

    yield make
    for srv in made:
        srv.shutdown()
        srv.server_close()


def test_concurrent_streams_are_measured_together(streaming):
    server = streaming([0.0], gap_s=0.04, together=3)
    got = server.timed_streams([1, 2, 3], n=12, count=3)
    # the three streams of 12 tokens start together and overlap for most of their ~0.5 s (a
    # fixed 0.24 s alone did not hold on a loaded host: one stream ended before the last began)
    assert got["batch"] == 3 and got["window_s"] > 0 and got["decode_tok_s"] > 0


def test_a_batch_that_never_overlaps_is_reported_not_invented(streaming):
    # the second request begins 1.5 s after the first, whose 3 tokens take ~0.1 s
    server = streaming([0.0, 1.5], gap_s=0.03)
    got = server.timed_streams([1], n=3, count=2)
    assert got["decode_tok_s"] is None and "never ran together" in got["why"]


def test_a_method_whose_streams_fail_keeps_the_others_results(monkeypatch, tmp_path):
    """`hack bench serve --decode-batch N`: a server whose concurrent streams fail (a BF16 server
    stopped by its watchdog at a long context, say) has its cell say why, and its throughput is
    not measured once the server is gone; the other methods' cells, and the run, go on."""
    import hack_cli.bench_serve as bench_serve
    import hack_eval.workloads as workloads
    from engine import launcher

    class FakeServer:
        def __init__(self, model_path, args, env=None):
            self.bf16 = "--kv-cache-dtype" not in args
            self.url, self.log_path, self.proc = "http://x", "log", type("P", (), {"pid": 1})()

        def start(self):
            return self

        def wait_ready(self):
            pass

        def stop(self):
            pass

        def kv_usage(self):
            return {"max_total_num_tokens": 1000}

        def flush_cache(self):
            if self.bf16 and self.gone:
                raise requests.ConnectionError("Connection refused")

        gone = False

        def timed_stream(self, ids, n):
            return {"decode_tok_s": 5.0, "prefill_tok_s": 50.0}

        def timed_streams(self, ids, n, count):
            if self.bf16:
                self.gone = True  # its watchdog stopped it
                raise RuntimeError(f"{count} concurrent streams of {n} tokens: ['ChunkedEncodingError']")
            return {"batch": count, "decode_tok_s": 20.0}

    monkeypatch.setattr(launcher, "SGLangServer", FakeServer)
    monkeypatch.setattr(workloads, "essay_ids", lambda path, n, index=0: [1] * n)
    monkeypatch.setattr(bench_serve, "_throughput", lambda url, prompts, n, conc: {
        "output_tok_s": 7.0, "errors": [], "latency_p50_s": 1.0})
    monkeypatch.setenv("HACK_RUNS_DIR", str(tmp_path))
    cfg = {"contexts": [64], "decode_tokens": 4, "decode_batch": 2, "budget_mb": 64, "requests": 1,
           "concurrency": 1, "tp_prompt": 8, "tp_tokens": 2}
    res = bench_serve._measure_all(["bf16", "hack"], "model", cfg, lambda *a: None)
    assert res["bf16"]["contexts"]["64"]["batch_decode"]["decode_tok_s"] is None
    assert "ChunkedEncodingError" in res["bf16"]["contexts"]["64"]["batch_decode"]["why"]
    assert res["hack"]["contexts"]["64"]["batch_decode"]["decode_tok_s"] == 20.0
    assert res["bf16"]["throughput"]["output_tok_s"] == 0.0 and "ConnectionError" in res["bf16"]["throughput"]["errors"][0]
    assert res["hack"]["throughput"]["output_tok_s"] == 7.0
