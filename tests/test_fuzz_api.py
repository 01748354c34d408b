"""Bad input against real servers: the malformed-request catalogue (each item a 4xx),
property-based fuzzing (hypothesis, fixed seed, bounded cases) of /generate, /v1/completions and
/v1/chat/completions, and schema fuzzing (schemathesis, from the server's own /openapi.json, of
every generation endpoint it serves: disagg.schema_fuzz, disagg.fuzz_scope), first on one
colocated HACK server, then on a colocated BF16 server (schema fuzzing, the same requests): the
shared test servers of tests/shared_servers.py (a server start costs this 2-core machine more than
a fuzz class; the fuzz property does not depend on their prefill mode or KV budget, and
`hack bench fuzz` fuzzes its own servers, disagg.fuzz_run.COLOCATED_ARGS), then through the
router of a 1P1D HACK cluster on loopback (the catalogue and hypothesis; the schema requests
through the router are `hack bench fuzz --targets router`: the Rust router answers some itself
with a 501 or not at all, docs/reliability.md). The property:
never a 5xx, never a dropped connection or a timeout (a 200 is fine: some generated bodies are
valid, and they are kept cheap); afterwards every server is alive, healthy, still generates, and
its KV pool is back to idle, and the router still counts every worker healthy.

Failures are collected over a whole run and reported together (no shrinking: each case is a
request to a real server, and the list of failing bodies is the useful report). The schema
requests are built once, from the first server's document, and the same ones go to every target.
"""
from __future__ import annotations

import json
import time
from typing import Callable

import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings

from disagg import cluster, procs
from disagg.fuzz_bodies import request_bodies
from disagg.fuzz_draws import module_independent
from disagg.fuzz_run import Target, TargetRun, fuzz_target, router_problems, server_problems
from disagg.fuzz_scope import CI_CORE, NOT_FUZZED, fuzzed_operations
from disagg.malformed import ROUTER_ANSWERS, BadRequest, Endpoint, bad_requests, send
from disagg.schema_fuzz import FAILURE_BODY_BYTES, Budget, FuzzRequest, build_requests, fetch_document, same_api
from engine.launcher import SGLangServer
from engine.request_checks import GENERATION_PATHS
from engine.usage import is_idle

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SERVER_CASES = 40  # hypothesis examples per endpoint on the colocated server
ROUTER_CASES = 15  # per endpoint through the PD router
REQUEST_TIMEOUT_S = 60.0  # a valid fuzz body generates at most 2 tokens (x4 for n)
IDLE_TIMEOUT_S = 60.0


# Schema fuzzing in CI: >= 500 requests for each endpoint of fuzz_scope.CI_CORE, fewer for the
# other generation endpoints (`hack bench fuzz` runs all of them at >= 5,000).
SCHEMA_BUDGET = Budget(per_endpoint=500, seed=0)
SCHEMA_BUDGET_OTHERS = Budget(per_endpoint=100, seed=0)


@pytest.fixture(scope="module")
def schema_cache() -> dict:
    """The schema requests of this module, built by the first test that needs them."""
    return {}


def _schema_requests(cache: dict, url: str, same_document: bool = True) -> dict[str, list[FuzzRequest]]:
    """The module's schema requests, built from the first server's document; a later colocated
    server must serve the same document (same_document). A PD server's differs from a colocated
    one's (its disaggregation mode changes what SGLang registers), so the router gets the
    colocated servers' requests without that check."""
    doc = fetch_document(url)
    if "doc" in cache:
        if same_document:
            assert same_api(doc, cache["doc"]), "this server's OpenAPI document differs from the first one's"
        return cache["requests"]
    paths = [p for p, _ in fuzzed_operations(doc)]
    reqs = {**build_requests(doc, SCHEMA_BUDGET, [p for p in paths if p in CI_CORE]),
            **build_requests(doc, SCHEMA_BUDGET_OTHERS, [p for p in paths if p not in CI_CORE])}
    cache.update(doc=doc, requests=reqs)
    return reqs


def _schema_run_holds(run: TargetRun, reqs: dict[str, list[FuzzRequest]]) -> None:
    for path, res in run.endpoints.items():
        print(f"\n[{run.target.value}] {path}: {res.sent} requests, statuses {dict(sorted(res.statuses.items()))}")
    assert not run.failures(), "\n".join(run.failures()[:40])
    assert {p: r.sent for p, r in run.endpoints.items()} == {p: len(v) for p, v in reqs.items()}


@pytest.fixture(scope="module")
def model_path() -> str:
    from hack_eval.models import prepare

    return str(prepare("smollm2", log=lambda *a, **k: None))


def _answer(url: str, req: BadRequest) -> str:
    """What the server says to `req` (for a failure's message)."""
    headers = {"Content-Type": req.content_type} if req.content_type else {}
    try:
        r = requests.post(url + req.path, data=req.body, headers=headers, timeout=REQUEST_TIMEOUT_S)
        return r.text[:200]
    except requests.RequestException as exc:
        return repr(exc)[:200]


def _catalogue_failures(url: str, skip: set[str] = frozenset()) -> list[str]:
    out = []
    for req in bad_requests():
        if req.name in skip:
            continue
        status = send(url, req, timeout=REQUEST_TIMEOUT_S)
        if not 400 <= status < 500:
            out.append(f"{req.name}: {status} {_answer(url, req) if status else ''}")
    return out


def _fuzz_failures(url: str, endpoint: Endpoint, cases: int,
                   excused: Callable[[str, bytes], bool] = lambda path, raw: False
                   ) -> tuple[list[str], dict[int, int]]:
    """Failing cases (5xx or no answer) and the count of each status; a failure `excused`
    says is the router's own is printed, not returned."""
    failures: list[str] = []
    statuses: dict[int, int] = {}

    @settings(max_examples=cases, derandomize=True, database=None, deadline=None,
              phases=(Phase.generate,), suppress_health_check=list(HealthCheck))
    @given(request_bodies(endpoint))
    def run(raw: bytes) -> None:
        status = send(url, BadRequest("fuzz", endpoint.value, raw), timeout=REQUEST_TIMEOUT_S)
        statuses[status] = statuses.get(status, 0) + 1
        if status == 0 or status >= 500:
            if excused(endpoint.value, raw):
                print(f"\n  the router's own answer {status} for {raw[:200]!r}")
            else:
                failures.append(f"{status} for {raw[:FAILURE_BODY_BYTES]!r}")  # enough to replay it

    with module_independent():  # the same draws here as in the whole suite
        run()
    return failures, statuses


def _kv_usage(url: str) -> dict:
    info = requests.get(f"{url}/server_info", timeout=30).json()
    return info["internal_states"][0]["hack_kv"]


def _assert_serving_and_idle(url: str, alive: Callable[[], bool], name: str) -> None:
    assert alive(), f"{name} is not running any more"
    assert requests.get(f"{url}/health", timeout=30).status_code == 200, name
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    usage = _kv_usage(url)
    while time.monotonic() < deadline:
        usage = _kv_usage(url)
        if is_idle(usage):
            assert usage["hack"] is not None, f"{name} has no HACK pool"
            return
        time.sleep(0.5)
    raise AssertionError(f"{name}: KV memory not back to idle within {IDLE_TIMEOUT_S}s: {usage}")


def _still_generates(url: str) -> None:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    r = requests.post(f"{url}/generate", json=body, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["meta_info"]["completion_tokens"] >= 1


# ---------------------------------------------------------------- one colocated HACK server

@pytest.fixture(scope="class")
def server(shared_servers) -> SGLangServer:
    """The shared HACK server (the BF16 one starts with it: two starts overlap on two cores, and the
    idle one sleeps)."""
    return shared_servers.get("smollm2_hack", starting_with=("smollm2_bf16",))


@pytest.mark.shared_servers("smollm2_hack", "smollm2_bf16")
class TestColocated:
    def _check_after(self, srv: SGLangServer) -> None:
        _assert_serving_and_idle(srv.url, lambda: srv.proc.poll() is None, "the HACK server")
        _still_generates(srv.url)

    def test_every_generation_endpoint_is_fuzzed_and_guarded(self, server):
        """Every path of the server's document is fuzzed or left out with a reason (a new
        endpoint joins the fuzz suite by default), no reason names a path the server lacks, and
        the HTTP guard covers every fuzzed endpoint."""
        doc = fetch_document(server.url)
        fuzzed = {p for p, _ in fuzzed_operations(doc)}
        assert set(CI_CORE) <= fuzzed
        assert not [p for p in NOT_FUZZED if p not in doc["paths"]], "stale fuzz_scope.NOT_FUZZED rows"
        assert fuzzed <= GENERATION_PATHS, f"fuzzed but not guarded: {sorted(fuzzed - GENERATION_PATHS)}"

    def test_schema_fuzz_never_5xx(self, server, schema_cache):
        reqs = _schema_requests(schema_cache, server.url)
        run = fuzz_target(Target.HACK, server.url, reqs, lambda: server.proc.poll() is None)
        run.problems += server_problems("the HACK server", server.url, lambda: server.proc.poll() is None)
        _schema_run_holds(run, reqs)

    def test_catalogue_gets_4xx(self, server):
        failures = _catalogue_failures(server.url)
        assert not failures, "not a 4xx:\n" + "\n".join(failures) + "\n" + server.log_tail(30)
        self._check_after(server)

    @pytest.mark.parametrize("endpoint", list(Endpoint), ids=lambda e: e.name.lower())
    def test_fuzz_never_5xx(self, server, endpoint):
        failures, statuses = _fuzz_failures(server.url, endpoint, SERVER_CASES)
        print(f"\n{endpoint.value}: {SERVER_CASES} cases, statuses {sorted(statuses.items())}")
        assert not failures, "\n".join(failures) + "\n" + server.log_tail(30)
        assert sum(statuses.values()) == SERVER_CASES
        self._check_after(server)


# ---------------------------------------------------------------- one colocated BF16 server

@pytest.fixture(scope="class")
def bf16_server(shared_servers) -> SGLangServer:
    return shared_servers.get("smollm2_bf16")


@pytest.mark.shared_servers("smollm2_bf16")
class TestBf16:
    def test_schema_fuzz_never_5xx(self, bf16_server, schema_cache):
        srv = bf16_server
        reqs = _schema_requests(schema_cache, srv.url)
        run = fuzz_target(Target.BF16, srv.url, reqs, lambda: srv.proc.poll() is None)
        run.problems += server_problems("the BF16 server", srv.url, lambda: srv.proc.poll() is None)
        _schema_run_holds(run, reqs)


# ---------------------------------------------------------------- a 1P1D cluster's router

# What each router answers itself for some catalogue items: disagg.malformed.ROUTER_ANSWERS.

def _mini_lb_answers_itself(path: str, raw: bytes) -> bool:
    """Fuzz bodies the mini-lb fails on before a server sees them (same causes as above): a
    truthy non-boolean `stream` (its streaming path; a dict there dropped the connection), and
    on /generate a `text` without len() or `input_ids` without [0]."""
    try:
        body = json.loads(raw)
    except ValueError:
        return False
    if not isinstance(body, dict):
        return False
    stream = body.get("stream", False)
    if stream and stream is not True:
        return True
    if path != Endpoint.GENERATE.value:
        return False
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None:
        return not isinstance(text, (str, list, dict))
    if ids is not None:
        try:
            ids[0]
        except (TypeError, KeyError, IndexError):
            return True
    return False


def _router_kind(state: dict) -> str:
    """"mini-lb" when the cluster's router is SGLang's mini-lb (`hack up --router mini-lb`),
    else "router" (the Rust router, `hack up`'s default), as the cluster state records it."""
    return "mini-lb" if state.get("router") == "mini-lb" else "router"


@pytest.fixture(scope="class")
def pd(model_path):
    spec = cluster.ClusterSpec(model_path=model_path, kv="hack", max_total_tokens=16384,
                               waiting_timeout_s=60, extra_server_args=["--sleep-on-idle"])
    state = cluster.up(spec, log=lambda m: None)
    try:
        yield state
    finally:
        cluster.down(state)


class TestRouter:
    def _check_after(self, state: dict) -> None:
        for s in state["servers"]:
            if s["role"] in ("prefill", "decode"):
                _assert_serving_and_idle(s["url"], lambda pid=int(s["pid"]): procs.alive(pid), s["role"])
        _still_generates(state["router_url"])

    def test_catalogue_gets_4xx(self, pd):
        url = pd["router_url"]
        known = ROUTER_ANSWERS[pd["router"]]
        failures = _catalogue_failures(url, skip=set(known))
        assert not failures, "not a 4xx through the router:\n" + "\n".join(failures)
        by_name = {r.name: r for r in bad_requests()}
        got = {name: send(url, by_name[name], timeout=REQUEST_TIMEOUT_S) for name in known}
        assert got == known, f"the router's documented answers changed: {got} (documented {known})"
        self._check_after(pd)

    def test_schema_fuzz_never_5xx(self, pd, schema_cache):
        """The colocated servers' schema requests for the endpoints the router routes (CI_CORE, 500
        each) through the Rust router: no 5xx, no drop, and neither worker marked unhealthy."""
        servers = [s for s in pd["servers"] if s["role"] in ("prefill", "decode")]
        reqs = {p: v for p, v in _schema_requests(schema_cache, servers[0]["url"], same_document=False).items()
                if p in CI_CORE}
        alive = lambda: all(procs.alive(int(s["pid"])) for s in pd["servers"])  # noqa: E731
        run = fuzz_target(Target.ROUTER, pd["router_url"], reqs, alive)
        run.problems += router_problems(pd["router_url"], len(servers))
        _schema_run_holds(run, reqs)
        self._check_after(pd)

    def test_parallel_sampling_is_refused_at_once(self, pd):
        """n > 1 through the router hung until the client gave up (found by `hack bench fuzz --targets
        router`); both PD servers now refuse it, so the router answers 400 at once, and nothing is left."""
        url = pd["router_url"]
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2, "n": 2}),
                           ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "n": 3}}),
                           ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2, "n": 2})):
            r = requests.post(url + path, json=body, timeout=30)
            assert r.status_code == 400 and "n > 1 (parallel sampling)" in r.text, (path, r.status_code, r.text[:300])
        self._check_after(pd)

    @pytest.mark.parametrize("endpoint", list(Endpoint), ids=lambda e: e.name.lower())
    def test_fuzz_never_5xx(self, pd, endpoint):
        excused = _mini_lb_answers_itself if _router_kind(pd) == "mini-lb" else (lambda path, raw: False)
        failures, statuses = _fuzz_failures(pd["router_url"], endpoint, ROUTER_CASES, excused)
        print(f"\nrouter {endpoint.value}: {ROUTER_CASES} cases, statuses {sorted(statuses.items())}")
        assert not failures, "\n".join(failures)
        self._check_after(pd)
