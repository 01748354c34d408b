"""hack bench fuzz: its doc block, each problem cut to a readable length (the JSON keeps the whole
failing body, which a replay needs), at most five listed; which OpenAPI documents count as the
same API; and how the fuzzer counts a dropped connection."""
from __future__ import annotations

from hack_cli.bench_fuzz import render


def _result(failures: list[str]) -> dict:
    endpoint = {"path": "/v1/messages", "sent": 100, "seconds": 1.0, "statuses": {"400": 93, "500": 7},
                "by_source": {}, "server_errors": 7, "failures": failures, "died_after": None}
    return {"command": "hack bench fuzz", "date": "2026-11-27", "model": "smollm2", "per_endpoint": 100,
            "seed": 6, "runs": [{"target": "hack", "endpoints": {"/v1/messages": endpoint}, "problems": [],
                                 "requests": 100, "server_errors": 7, "wall_s": 9.0}]}


def _summary(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("- hack:"))


def test_long_problems_are_cut_and_the_rest_left_to_the_json():
    body = "500 for POST /v1/messages [coverage, application/json] b'{" + "x" * 2000 + "}'"
    summary = _summary(render(_result([body] * 7)))
    assert "7 problem(s)" in summary and summary.endswith("; the rest in the JSON")
    assert summary.count(" ...") == 5 and len(summary) < 5 * 260 + 200


def test_short_problems_are_listed_whole():
    summary = _summary(render(_result(["500 for POST /v1/messages b'{}'"])))
    assert summary.endswith("1 problem(s): /v1/messages: 500 for POST /v1/messages b'{}'")
    assert "| hack | `/v1/messages` | 100 | 0 | 93 | 7 | 0 | 1.0 |" in render(_result([]))


def test_two_processes_of_one_server_describe_the_same_api():
    """FastAPI names a route served for GET and POST after one method taken from a set, so two
    processes of the same server differ in operationId alone: `hack bench fuzz` sends the same
    requests to both. Any other difference keeps them apart."""
    from disagg.schema_fuzz import same_api

    def doc(op_id: str, summary: str = "Generate") -> dict:
        return {"paths": {"/generate": {"post": {"operationId": op_id, "summary": summary},
                                        "put": {"operationId": op_id, "summary": summary}}}}

    assert same_api(doc("generate_request_generate_put"), doc("generate_request_generate_post"))
    assert not same_api(doc("a"), doc("a", summary="Other"))


class _Dropper:
    """A TCP server on 127.0.0.1 that closes the first `drops` connections as soon as a request
    arrives (no answer) and answers 400 on every later one: a dropped request, then a server that
    answers."""

    def __init__(self, drops: int) -> None:
        import socket
        import threading

        self.drops, self.connections = drops, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.connections += 1
                conn.recv(65536)
                if self.connections > self.drops:
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    def close(self) -> None:
        self.sock.close()


def _request():
    from disagg.schema_fuzz import CaseSource, FuzzRequest

    return FuzzRequest("/generate", CaseSource.COVERAGE, "POST", "/generate", (), b"")


def test_a_drop_is_sent_again_on_a_new_connection_and_only_a_second_drop_fails():
    """disagg.schema_fuzz.run_requests: a request dropped once (a keep-alive connection the server
    closed) is sent once more on a new connection and its answer counts; dropped there too, it is
    the failure; with the server gone it is not sent again."""
    from disagg.schema_fuzz import run_requests

    once = _Dropper(drops=1)
    try:
        res = run_requests(once.url, [_request()], alive=lambda: True, timeout=5)
        assert dict(res.statuses) == {400: 1} and not res.failures and once.connections == 2
    finally:
        once.close()
    always = _Dropper(drops=10)
    try:
        res = run_requests(always.url, [_request()], alive=lambda: True, timeout=5)
        assert dict(res.statuses) == {0: 1} and len(res.failures) == 1 and always.connections == 2
        res = run_requests(always.url, [_request()], alive=lambda: False, timeout=5)
        assert res.died_after and always.connections == 3  # not sent again to a dead server
    finally:
        always.close()
