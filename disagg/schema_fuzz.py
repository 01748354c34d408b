"""Schema-driven fuzzing of a server's generation endpoints with schemathesis, from the server's
own /openapi.json (disagg.fuzz_scope says which operations).

Cases come from schemathesis' two generating phases and from mutations of its valid cases, each
with a fixed seed, so a run sends the same bytes every time for the same document and budget:
  coverage  the coverage phase: for every field, valid values, boundary values, wrong types,
            values outside an enum, missing required fields, and whole-request mutations (wrong
            Content-Type, no body, other HTTP methods); its stream is sampled across fields
            (round-robin over the case descriptions of its first `COVERAGE_SCAN` cases per mode),
            because it is combinatorial (tens of thousands of cases for /v1/chat/completions,
            most of them inside one recursive field);
  positive  the fuzzing phase, bodies valid under the schema (hypothesis, fixed seed);
  mutated   a positive case with one field (at the top or one object down) replaced by a wrong
            value, removed, or joined by an unknown key, or the whole body replaced by another
            JSON value (seeded). schemathesis' own negative fuzzing is not used: on SGLang's
            completion and chat schemas it took 10 to 50 s per case here.
Every case is serialized once into a `FuzzRequest` (method, path with query, headers, body bytes),
so the very same requests go to a HACK server, a BF16 server and through the router.

Valid cases stay cheap (`keep_cheap`): token budgets above 2 are lowered to 2 and a missing or null
budget is set to 2 (SGLang's defaults are 128 tokens, 2048 for Ollama's endpoints, the whole
context for chat), `n` and `best_of`
above 4 are lowered to 4; wrong types and values are never touched. What a server must do with
the requests (never a 5xx, never a dropped connection or a timeout, stay up) is checked by
`run_requests` and the callers.
"""
from __future__ import annotations

import itertools
import json
import random
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable

import requests

from .fuzz_draws import module_independent
from .fuzz_scope import fuzzed_operations

CHEAP_TOKENS = 2  # the most tokens a valid fuzz case may ask for
CHEAP_N = 4  # the most samples (n, best_of)
COVERAGE_SCAN = 6000  # coverage cases looked at per mode and endpoint before sampling
REQUEST_TIMEOUT_S = 60.0
FAILURE_BODY_BYTES = 2000  # enough of a failing body to replay it from a CI log
_BASE = "http://fuzz.invalid"  # requests are prepared against a placeholder, sent to the target

# Token budgets by name, wherever they appear (top level, sampling_params, Ollama's options,
# Vertex's parameters); the minimums are lowered to the same cap so they never exceed it.
BUDGET_KEYS = frozenset({"max_new_tokens", "max_tokens", "max_completion_tokens", "max_output_tokens",
                         "num_predict", "min_new_tokens", "min_tokens"})
SAMPLE_KEYS = frozenset({"n", "best_of"})
# Where each endpoint's budget lives when a body leaves it out (a path of keys into the body).
DEFAULT_BUDGET: dict[str, tuple[str, ...]] = {
    "/generate": ("sampling_params", "max_new_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/chat/completions": ("max_tokens",),
    "/invocations": ("max_tokens",),
    "/v1/messages": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
    "/api/generate": ("options", "num_predict"),
    "/api/chat": ("options", "num_predict"),
    "/vertex_generate": ("parameters", "sampling_params", "max_new_tokens"),
}


class CaseSource(str, Enum):
    COVERAGE = "coverage"
    POSITIVE = "positive"
    MUTATED = "mutated"


@dataclass(frozen=True)
class Budget:
    """Requests per endpoint, split between the sources: coverage 60%, positive and mutated 20%
    each (a coverage case costs ~0.01 s to generate here, a positive one up to ~0.4 s)."""
    per_endpoint: int
    seed: int = 0

    def split(self) -> dict[CaseSource, int]:
        cov = round(0.6 * self.per_endpoint)
        pos = round(0.2 * self.per_endpoint)
        return {CaseSource.COVERAGE: cov, CaseSource.POSITIVE: pos,
                CaseSource.MUTATED: self.per_endpoint - cov - pos}


@dataclass(frozen=True)
class FuzzRequest:
    path: str  # the operation's path (what results are grouped by)
    source: CaseSource
    method: str
    target: str  # path and query string as sent
    headers: tuple[tuple[str, str], ...]
    body: bytes | None

    def send(self, base_url: str, session: requests.Session, timeout: float = REQUEST_TIMEOUT_S) -> int:
        """The HTTP status; 0 when the connection failed, was dropped or timed out."""
        try:
            r = session.request(self.method, base_url.rstrip("/") + self.target, data=self.body,
                                headers=dict(self.headers), timeout=timeout, allow_redirects=False)
            r.content  # read the whole answer: a stream that breaks off is a dropped connection
        except requests.RequestException:
            return 0
        return int(r.status_code)

    def describe(self, limit: int = 300) -> str:
        body = b"" if self.body is None else self.body
        ctype = dict(self.headers).get("Content-Type", "-")
        return f"{self.method} {self.target} [{self.source.value}, {ctype}] {body[:limit]!r}"


# ---------------------------------------------------------------- cheap valid cases

def keep_cheap(path: str, body: Any) -> Any:
    """`body` with every token budget capped at CHEAP_TOKENS, samples at CHEAP_N, and the
    endpoint's budget set where the body is an object that leaves it out (see the module doc)."""
    body = _cap(body, depth=0)
    where = DEFAULT_BUDGET.get(path)
    if where and isinstance(body, dict):
        _set_budget(body, where)
    return body


def _set_budget(node: dict, where: tuple[str, ...]) -> None:
    key, rest = where[0], where[1:]
    if not rest:
        if node.get(key) is None:
            node[key] = CHEAP_TOKENS
        return
    if node.get(key) is None:  # null means absent for these optional containers
        node[key] = {}
    child = node[key]
    # A list there is a batch (one sampling_params per prompt); any other type is the case
    # itself, left alone.
    for item in child if isinstance(child, list) else [child]:
        if isinstance(item, dict):
            _set_budget(item, rest)


def _cap(value: Any, depth: int) -> Any:
    if depth > 4:
        return value
    if isinstance(value, list):
        return [_cap(v, depth + 1) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for k, v in value.items():
        if _is_int(v) and k in BUDGET_KEYS and v > CHEAP_TOKENS:
            v = CHEAP_TOKENS
        elif _is_int(v) and k in SAMPLE_KEYS and v > CHEAP_N:
            v = CHEAP_N
        else:
            v = _cap(v, depth + 1)
        out[k] = v
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------- generation

def load_schema(doc: dict[str, Any]) -> Any:
    """A schemathesis schema of the OpenAPI document `doc` (a server's /openapi.json)."""
    import schemathesis

    return schemathesis.openapi.from_dict(doc)


def same_api(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two servers' OpenAPI documents describe the same requests. FastAPI names a route
    served for several methods after one of them, taken from a set, so `operationId` differs
    between two processes of the same server; nothing else may."""
    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "operationId"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return strip(a) == strip(b)


def fetch_document(base_url: str, timeout: float = 30.0) -> dict[str, Any]:
    r = requests.get(base_url.rstrip("/") + "/openapi.json", timeout=timeout)
    r.raise_for_status()
    return r.json()


def to_request(path: str, source: CaseSource, case: Any) -> FuzzRequest:
    """Serialize a schemathesis case, its budget kept cheap."""
    kw = case.as_transport_kwargs(base_url=_BASE)
    if "json" in kw:
        kw["json"] = keep_cheap(path, kw["json"])
    headers = {k: v for k, v in (kw.get("headers") or {}).items()
               if not k.lower().startswith("x-schemathesis")}  # random per case: not part of it
    prepared = requests.Request(method=kw["method"], url=kw["url"], headers=headers,
                                params=kw.get("params") or None, data=kw.get("data"),
                                json=kw.get("json"), cookies=kw.get("cookies") or None).prepare()
    body = prepared.body.encode() if isinstance(prepared.body, str) else prepared.body
    return FuzzRequest(path=path, source=source, method=str(prepared.method),
                       target=prepared.path_url, headers=tuple(sorted(prepared.headers.items())),
                       body=body)


def _coverage_cases(schema: Any, op: Any, modes: Iterable[Any]) -> Iterable[Any]:
    from schemathesis.generation.drivers import CoverageGenerator
    from schemathesis.generation.feedback import FeedbackSources
    from schemathesis.generation.overrides import Override

    config = schema.config.generation_for(operation=op, phase="coverage")
    return CoverageGenerator(operation=op, generation_modes=list(modes), generation_config=config,
                             auth_storage=None, override=Override(), feedback=FeedbackSources())


def coverage_requests(schema: Any, path: str, method: str, count: int) -> list[FuzzRequest]:
    """`count` coverage-phase requests, spread over the case descriptions (which field, which
    mutation) of the first COVERAGE_SCAN cases of each generation mode, half positive and half
    negative where both have enough."""
    from schemathesis.generation import GenerationMode

    op = schema[path][method]
    per_mode: list[list[FuzzRequest]] = []
    for mode in (GenerationMode.NEGATIVE, GenerationMode.POSITIVE):
        buckets: OrderedDict[str, list[Any]] = OrderedDict()
        for case in itertools.islice(_coverage_cases(schema, op, [mode]), COVERAGE_SCAN):
            data = case.meta.phase.data if case.meta is not None else None
            key = getattr(data, "description", "") or ""
            buckets.setdefault(key, []).append(case)
        # Round-robin over the descriptions, in the order the phase produced them.
        ordered = [c for group in itertools.zip_longest(*buckets.values()) for c in group if c is not None]
        per_mode.append(_unique(to_request(path, CaseSource.COVERAGE, c) for c in ordered))
    neg, pos = per_mode
    take_neg = min(len(neg), max(count - len(pos), (count + 1) // 2))
    return neg[:take_neg] + pos[:count - take_neg]


def positive_cases(schema: Any, path: str, method: str, count: int, seed: int) -> list[Any]:
    """`count` fuzzing-phase cases valid under the schema (hypothesis with a fixed seed; fewer
    when hypothesis runs out of distinct ones)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from schemathesis.generation import GenerationMode

    strategy = schema[path][method].as_strategy(generation_mode=GenerationMode.POSITIVE)
    out: list[Any] = []
    seen: set[FuzzRequest] = set()
    for attempt in range(4):  # hypothesis repeats some examples: top up with the next seed
        want = count - len(out)
        if want <= 0:
            break

        @hseed(seed + attempt)
        @settings(max_examples=want, database=None, deadline=None, phases=(Phase.generate,),
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def draw(case: Any) -> None:
            req = to_request(path, CaseSource.POSITIVE, case)
            if req not in seen and len(out) < count:
                seen.add(req)
                out.append(case)

        with module_independent():
            draw()
    return out


# Wrong values a mutation puts in a field: the numeric edges checks tend to miss, the wrong
# container types, and empty and nested-empty values (the shapes `input_embeds` crashed on).
WRONG_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2**31, -(2**63), 2**64, 10**12, -0.5, 0.5, 1e308, float("nan"),
    float("inf"), float("-inf"), "", "x", "\u0000", "1", [], [[]], [[], []], [0], [-1], [1.5], [[1.5]],
    [[1.5], [1.5, 2.5]], [[[]]], ["a", 1], {}, {"": None}, {"a": []}, [{}], [None],
)


def mutate(body: Any, rng: random.Random) -> Any:
    """A copy of `body` with one thing wrong (see the module doc); `rng` decides what."""
    if not isinstance(body, dict) or rng.random() < 0.1:
        return rng.choice(WRONG_VALUES)  # the body as a whole
    out = json.loads(json.dumps(body))
    # A field at the top, or one object down (sampling_params, options, ...).
    node: dict = out
    nested = [k for k, v in out.items() if isinstance(v, dict) and v]
    if nested and rng.random() < 0.4:
        node = out[rng.choice(sorted(nested))]
    action = rng.choice(("replace", "replace", "replace", "remove", "extra"))
    if action == "extra" or not node:
        node[rng.choice(("x", "unknown_field", "", "text", "input_embeds", "stream"))] = rng.choice(WRONG_VALUES)
    elif action == "remove":
        node.pop(rng.choice(sorted(node)))
    else:
        node[rng.choice(sorted(node))] = rng.choice(WRONG_VALUES)
    return out


def mutated_request(path: str, case: Any, rng: random.Random) -> FuzzRequest:
    """A positive case's request with its JSON body mutated (serialized with NaN and Infinity
    as Python writes them: SGLang's parser reads them)."""
    req = to_request(path, CaseSource.MUTATED, case)
    try:
        body = json.loads(req.body) if req.body else {}
    except ValueError:
        body = {}
    raw = json.dumps(keep_cheap(path, mutate(body, rng))).encode()
    headers = {k: v for k, v in req.headers if k.lower() != "content-length"}
    headers["Content-Type"] = "application/json"
    headers["Content-Length"] = str(len(raw))
    return FuzzRequest(path=path, source=CaseSource.MUTATED, method=req.method, target=req.target,
                       headers=tuple(sorted(headers.items())), body=raw)


def _unique(reqs: Iterable[FuzzRequest]) -> list[FuzzRequest]:
    seen: set[FuzzRequest] = set()
    out = []
    for r in reqs:
        if r not in seen:
            seen.add(r)
            out.append(r)
    return out


def build_requests(doc: dict[str, Any], budget: Budget, paths: Iterable[str] | None = None,
                   log: Callable[[str], None] = lambda m: None) -> dict[str, list[FuzzRequest]]:
    """Per fuzzed path of `doc` (or only `paths`, each of which must be fuzzed there), its
    requests: the coverage sample, the positive cases, then the mutated ones; always
    `budget.per_endpoint` distinct requests (the coverage sample of a small schema can fall
    short: more positive and mutated cases make up the rest)."""
    schema = load_schema(doc)
    ops = fuzzed_operations(doc)
    if paths is not None:
        wanted = list(paths)
        missing = [p for p in wanted if p not in {p for p, _ in ops}]
        if missing:
            raise ValueError(f"not a fuzzed operation of this document: {', '.join(missing)}")
        ops = [(p, m) for p, m in ops if p in wanted]
    split = budget.split()
    out: dict[str, list[FuzzRequest]] = {}
    for path, method in ops:
        t0 = time.monotonic()
        reqs = coverage_requests(schema, path, method, split[CaseSource.COVERAGE])
        rest = budget.per_endpoint - len(reqs)
        n_pos = rest - rest // 2
        cases = positive_cases(schema, path, method, n_pos, budget.seed)
        reqs = _unique(reqs + [to_request(path, CaseSource.POSITIVE, c) for c in cases])
        seen = set(reqs)
        rng = random.Random(f"{budget.seed}:{path}")
        for i in itertools.count():
            if len(reqs) >= budget.per_endpoint or i >= 20 * budget.per_endpoint or not cases:
                break
            req = mutated_request(path, cases[i % len(cases)], rng)
            if req not in seen:
                seen.add(req)
                reqs.append(req)
        out[path] = reqs
        log(f"{method} {path}: {len(reqs)} requests "
            f"({dict(Counter(r.source.value for r in reqs))}) in {time.monotonic() - t0:.1f} s")
    return out


# ---------------------------------------------------------------- sending

@dataclass
class EndpointResult:
    path: str
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)
    by_source: dict[str, Counter] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # 5xx and dropped connections, described
    died_after: str | None = None  # the request after which the server was found dead
    seconds: float = 0.0

    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s == 0 or s >= 500)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "sent": self.sent, "seconds": round(self.seconds, 1),
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "by_source": {k: {str(s): n for s, n in sorted(c.items())} for k, c in self.by_source.items()},
                "server_errors": self.server_errors(), "failures": self.failures[:50],
                "died_after": self.died_after}


def run_requests(base_url: str, reqs: list[FuzzRequest], alive: Callable[[], bool],
                 timeout: float = REQUEST_TIMEOUT_S,
                 excused: Callable[[FuzzRequest, int], bool] = lambda r, s: False) -> EndpointResult:
    """Send `reqs` one at a time. A 5xx or a dropped connection is a failure unless `excused`
    says it is a documented answer; after a dropped connection the server must still be
    `alive()`, else the run stops there (the request that killed it is named). A request
    dropped on a reused keep-alive connection is sent once more on a new one, and only a drop
    there counts: a server may close an idle connection (after an answer that left the body
    unread, say) while the client is already writing on it, and the request then never reaches
    it (seen once through the Rust router under load: its log had every request it received
    answered)."""
    res = EndpointResult(path=reqs[0].path if reqs else "")
    t0 = time.monotonic()
    with requests.Session() as session:
        for req in reqs:
            status = req.send(base_url, session, timeout)
            if status == 0 and alive():
                with requests.Session() as fresh:
                    status = req.send(base_url, fresh, timeout)
            res.sent += 1
            res.statuses[status] += 1
            res.by_source.setdefault(req.source.value, Counter())[status] += 1
            if (status == 0 or status >= 500) and not excused(req, status):
                res.failures.append(f"{status} for {req.describe(FAILURE_BODY_BYTES)}")
            if status == 0 and not alive():
                res.died_after = req.describe()
                break
    res.seconds = time.monotonic() - t0
    return res


def save_requests(reqs: dict[str, list[FuzzRequest]]) -> str:
    """The requests as JSON lines (for a failure report or a replay)."""
    lines = []
    for path, items in reqs.items():
        for r in items:
            lines.append(json.dumps({"path": path, "source": r.source.value, "method": r.method,
                                     "target": r.target, "headers": dict(r.headers),
                                     "body": None if r.body is None else r.body.decode("latin-1")}))
    return "\n".join(lines) + "\n"
