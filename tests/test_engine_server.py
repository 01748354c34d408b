"""Real SGLang servers on the CPU with the plugin: `--kv-cache-dtype hack` next to a BF16 server
on the same model (SmolLM2-135M from `hack model prepare smollm2`), same fixed KV budget.

The HACK and BF16 servers are the shared ones of tests/shared_servers.py (tests/test_engine_speed.py
measures the same two): started once, with `--sleep-on-idle` so the idle one does not take a core
from the busy one, stopped after the last test that uses them; bounded waits everywhere. The dense
prefill server has flags of its own and is this module's.

Accuracy threshold. The project's accuracy study (docs/accuracy.md, hack eval accuracy) measures
how often the 2-bit cache's next-token argmax equals the exact model's, teacher-forced over
essays and plays; the earlier probe (notes: per-channel K + sinks) found ~72% at 2K tokens,
with a BF16-rounding-only floor of 99.6%. Here the same quantity is measured through the
servers (input_top_logprobs over the same token ids) and must stay above
TEACHER_FORCED_MIN; greedy free-running agreement is reported, not asserted (two greedy
sequences that differ once follow different paths afterwards).
"""
from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from engine.launcher import SGLangServer
from hack_eval.workloads import SHORT_PROMPTS, common_prefix, essay_ids

from shared_servers import COMMON, SMOLLM2_BUDGET_MB

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.shared_servers("smollm2_hack", "smollm2_bf16")]

BUDGET_MB = SMOLLM2_BUDGET_MB
TEACHER_FORCED_MIN = 0.60
# The default server holds the shipped bit plan (hack_ops/plans/: 14 of 60 K and V tensors at 4 bits,
# 20.0% of BF16's bytes at 4K): x4.56 by the pool's own arithmetic at 256 MB, the >= 4.5x target.
CAPACITY_MIN_RATIO = 4.5
IDLE_TIMEOUT_S = 60.0
PREFIX_TOP1_MIN = 0.9  # cold vs warm top-1 on the recomputed tail (test_prefix_reuse)
PREFIX_DRIFT_MAX = 0.75  # nat, largest |d logprob| there (measured up to 0.25)
DENSE_CHUNK = 256  # --chunked-prefill-size of the --hack-prefill dense server
DENSE_TF_SLACK = 0.02  # dense vs homomorphic teacher-forced top-1 (both vs BF16), see the test


@pytest.fixture(scope="module")
def model_path() -> str:
    from hack_eval.models import prepare

    return str(prepare("smollm2", log=lambda *a, **k: None))


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory, shared_servers):
    logs = tmp_path_factory.mktemp("servers")
    # The shared HACK server names the homomorphic prefill, not --hack-prefill auto (dense on a
    # CPU with AMX-BF16): the bars below and the dense comparison mean the same on every host.
    # Small chunks here, so that most of a prompt is prefilled over a cached prefix (the dense path).
    dense = SGLangServer(model_path, ["--kv-cache-dtype", "hack", "--hack-prefill", "dense",
                                      "--chunked-prefill-size", str(DENSE_CHUNK), *COMMON],
                         log_path=logs / "dense.log")
    try:
        dense.start()  # starts while the shared servers do
        hack = shared_servers.get("smollm2_hack", starting_with=("smollm2_bf16",))
        bf16 = shared_servers.get("smollm2_bf16")
        dense.wait_ready()
        yield {"hack": hack, "bf16": bf16, "dense": dense, "metrics_dir": shared_servers.metrics_dir("smollm2_hack")}
    finally:
        dense.stop()


def _ids(out: dict) -> list[int]:
    return list(out["output_ids"])


def _scored(server: SGLangServer, ids: list[int], start: int) -> tuple[list[float], list[int], int]:
    """One teacher-forced request: the log-probabilities of ids[start+1:], the server's top-1
    next-token prediction at every position >= start, and how many tokens came from its cache."""
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 1,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 1}}
    r = requests.post(server.url + "/generate", json=body, timeout=900)
    r.raise_for_status()
    meta = r.json()["meta_info"]
    logps = [t[0] for t in meta["input_token_logprobs"]][1:]
    tops = [int(t[0][1]) for t in meta["input_top_logprobs"] if t]
    return logps, tops, meta["cached_tokens"]


def _argmax_over(server: SGLangServer, ids: list[int], start: int) -> list[int]:
    """The server's top-1 next-token prediction at every position >= start of `ids`."""
    return _scored(server, ids, start)[1]


def _wait_idle(server: SGLangServer, timeout: float = IDLE_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout
    usage = server.kv_usage()
    while time.monotonic() < deadline:
        usage = server.kv_usage()
        if usage["request_rows_in_use"] == 0 and usage["used_tokens"] == usage["radix_cached_tokens"]:
            return usage
        time.sleep(0.5)
    raise AssertionError(f"KV memory did not return to idle within {timeout}s: {usage}")


def test_capacity_same_budget(servers):
    hack, bf16 = servers["hack"].kv_usage(), servers["bf16"].kv_usage()
    ratio = hack["max_total_num_tokens"] / bf16["max_total_num_tokens"]
    print(f"\nmax total tokens with a {BUDGET_MB} MB KV budget: HACK {hack['max_total_num_tokens']}, "
          f"BF16 {bf16['max_total_num_tokens']} (x{ratio:.2f})")
    assert hack["hack"] is not None and bf16["hack"] is None
    assert ratio >= CAPACITY_MIN_RATIO
    # everything the HACK pool holds (pages, tails, sinks) fits the same budget
    held = sum(hack["hack"]["bytes"].values())
    assert held <= int(BUDGET_MB) * (1 << 20) * 1.01, held


def test_greedy_agreement_with_bf16(servers, model_path):
    """Eight 256-token essay windows (four pages each, so most of the context is 2-bit pages;
    shorter prompts would sit entirely in the FP16 open partition) and 24 greedy tokens."""
    n_new, n_prompt = 24, 256
    tf_hits = tf_total = 0
    prefixes = []
    for i in range(8):
        ids = essay_ids(model_path, n_prompt, index=i)
        ref = servers["bf16"].generate(ids, n_new)
        got = servers["hack"].generate(ids, n_new)
        a, b = _ids(ref), _ids(got)
        prefixes.append(common_prefix(a, b))
        # teacher-forced: HACK's argmax at every position after the first page, on BF16's text
        full = ids + a
        ref_pred = _argmax_over(servers["bf16"], full, 64)
        got_pred = _argmax_over(servers["hack"], full, 64)
        n = min(len(ref_pred), len(got_pred))
        tf_hits += sum(int(x == y) for x, y in zip(ref_pred[:n], got_pred[:n]))
        tf_total += n
    tf = tf_hits / tf_total
    print(f"\ngreedy common prefix (of {n_new} tokens) per prompt: {prefixes}")
    print(f"teacher-forced top-1 agreement with BF16 over {tf_total} positions: {tf:.3f}")
    assert tf >= TEACHER_FORCED_MIN
    assert sum(prefixes) > 0  # the same first tokens at least somewhere (same model, same text)


def test_long_prompt_over_many_pages(servers, model_path):
    ids = essay_ids(model_path, 1800)  # 29 pages of 64 tokens
    servers["hack"].flush_cache()
    ref_pred = _argmax_over(servers["bf16"], ids, 0)
    got_pred = _argmax_over(servers["hack"], ids, 0)
    n = min(len(ref_pred), len(got_pred))
    assert n >= len(ids) - 2
    agree = sum(int(x == y) for x, y in zip(ref_pred[:n], got_pred[:n])) / n
    print(f"\n1800-token essay: teacher-forced top-1 agreement HACK vs BF16 {agree:.3f} over {n} positions")
    assert agree >= TEACHER_FORCED_MIN
    out = servers["hack"].generate(ids, 16)
    assert out["meta_info"]["completion_tokens"] >= 1
    assert out["meta_info"]["prompt_tokens"] == len(ids)


def test_eight_concurrent_requests(servers, model_path):
    """8 requests at once (96-token prompts: each closes a page in prefill, decodes in the next)
    give what each gives alone, up to float summation order in the model's batched matmuls."""
    prompts = [essay_ids(model_path, 96, index=i) for i in range(8)]
    solo = [_ids(servers["hack"].generate(p, 12)) for p in prompts]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = _ids(servers["hack"].generate(prompts[i], 12))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert not errors, errors
    assert sorted(results) == list(range(8))
    same = [common_prefix(solo[i], results[i]) for i in range(8)]
    print("\nbatched vs solo common prefix (of 12):", same)
    assert sum(s >= 8 for s in same) >= 7
    _wait_idle(servers["hack"])


def test_prefix_reuse(servers, model_path):
    """A prompt served again reuses its cached pages and scores its recomputed tail as the
    cold prefill did, within the difference SGLang's own BF16 server shows. Bit equality is
    not the bar: SGLang's CPU forward of the same tokens in a 700-token batch and in a 60-token
    one differs in the last bits (its BF16 server with --page-size 64 measures top-1 agreement
    0.98-1.0 and |d logprob| up to 0.15 nat on these essays; HACK 0.97-1.0 and up to 0.25,
    2026-11-25), so greedy continuations may part at a near tie. The bars leave 3x HACK's
    measured drift."""
    hack = servers["hack"]
    ids = essay_ids(model_path, 700, index=1)
    boundary = 640  # 10 full pages of 64: what the radix cache keeps; 60 tokens are recomputed
    hack.flush_cache()
    cold_lp, cold_top, cold_cached = _scored(hack, ids, boundary)
    warm_lp, warm_top, warm_cached = _scored(hack, ids, boundary)
    assert cold_cached == 0
    assert warm_cached >= boundary
    agree = sum(a == b for a, b in zip(cold_top, warm_top)) / len(cold_top)
    drift = max(abs(a - b) for a, b in zip(cold_lp, warm_lp))
    print(f"\nprefix reuse: cached {warm_cached}, top-1 agreement {agree:.3f}, max |d logprob| {drift:.3f}")
    assert len(cold_lp) == len(ids) - boundary - 1 and len(cold_top) >= len(cold_lp)
    assert agree >= PREFIX_TOP1_MIN
    assert drift <= PREFIX_DRIFT_MAX
    # greedy generation on the warm cache: tokens come back and the pages stay cached
    assert len(_ids(hack.generate(ids, 16))) == 16
    usage = _wait_idle(hack)
    assert usage["radix_cached_tokens"] >= boundary


def test_abort_and_disconnect_free_memory(servers):
    hack = servers["hack"]
    hack.flush_cache()
    idle = _wait_idle(hack)
    assert idle["used_tokens"] == 0
    # client disconnect in the middle of a streamed generation
    body = {"text": SHORT_PROMPTS[3], "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 400, "ignore_eos": True}}
    with requests.post(hack.url + "/generate", json=body, stream=True, timeout=300) as r:
        chunks = 0
        for line in r.iter_lines():
            if line:
                chunks += 1
            if chunks >= 3:
                break
    usage = _wait_idle(hack)
    assert usage["hack"]["sink_slots_in_use"] <= 1  # only a cached first page may keep its sinks
    # explicit abort of a running request
    rid = "abort-me-1"
    body = {"text": SHORT_PROMPTS[6], "rid": rid,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 400, "ignore_eos": True}}
    t = threading.Thread(target=lambda: requests.post(hack.url + "/generate", json=body, timeout=300))
    t.start()
    deadline = time.monotonic() + 60
    while hack.kv_usage()["request_rows_in_use"] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    requests.post(hack.url + "/abort_request", json={"rid": rid}, timeout=30).raise_for_status()
    t.join(timeout=120)
    _wait_idle(hack)
    hack.flush_cache()
    usage = _wait_idle(hack)
    assert usage["used_tokens"] == 0 and usage["hack"]["sink_slots_in_use"] == 0


@pytest.mark.parametrize("payload", [
    "{not json",
    json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": -5}}),
    json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 10 ** 12}}),
    json.dumps({"input_ids": list(range(1, 10000)), "sampling_params": {"max_new_tokens": 4}}),
    json.dumps({"text": 12345, "sampling_params": {"max_new_tokens": 4}}),
    json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": "ten"}}),
    json.dumps({"text": "hi", "sampling_params": {"temperature": "hot"}}),
    json.dumps({"input_ids": [-3, 5], "sampling_params": {"max_new_tokens": 4}}),
])
def test_malformed_requests_get_4xx(servers, payload):
    hack = servers["hack"]
    r = requests.post(hack.url + "/generate", data=payload, headers={"Content-Type": "application/json"},
                      timeout=120)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    # and the server keeps serving
    assert hack.generate("The capital of France is", 2)["meta_info"]["completion_tokens"] >= 1


def test_timeline_and_memory_are_recorded(servers):
    """The scheduler hooks record each request's phases and the pool's memory (engine.timeline)."""
    from hack_metrics.runload import RunLoader

    hack = servers["hack"]
    out = hack.generate(SHORT_PROMPTS[0], 6)
    rid = out["meta_info"]["id"]
    deadline = time.monotonic() + 30
    while True:
        rec = RunLoader(servers["metrics_dir"]).load().records
        mine = rec[rec["rid"] == rid] if len(rec) else rec
        if (len(mine) and "finish" in set(mine["kind"])) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    kinds = list(mine["kind"])
    assert kinds[0] == "arrival" and "finish" in kinds and "first_token" in kinds, kinds
    phases = set(mine.loc[mine["kind"].isin(["start", "end"]), "phase"])
    assert {"queue", "prefill"} <= phases
    assert (mine["kind"] == "step").sum() >= 4  # 6 tokens: the first from prefill, then steps
    # Fused phases, timed on the host clock inside the CPU path and attributed to this request.
    spans = mine[mine["kind"] == "span"]
    fused = dict(zip(spans["phase"], spans["dur_ns"]))
    assert fused.get("quantization", 0) > 0 and fused.get("approximation", 0) > 0, fused
    assert set(spans.loc[spans["phase"].isin(["quantization", "approximation"]), "method"]) == {"attributed"}
    assert "dequantization" not in fused  # 'hack' mode never dequantizes
    assert int(mine.loc[mine["kind"] == "finish", "tokens"].iloc[0]) == out["meta_info"]["completion_tokens"]
    samples = rec[rec["kind"] == "sample"]
    assert len(samples) and samples["pages_total"].max() > 0 and samples["bytes_codes"].notna().any()


def test_openai_compatible_endpoints(servers):
    hack = servers["hack"]
    model = requests.get(hack.url + "/v1/models", timeout=60).json()["data"][0]["id"]
    r = requests.post(hack.url + "/v1/completions", timeout=900, json={
        "model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] >= 1
    r = requests.post(hack.url + "/v1/chat/completions", timeout=900, json={
        "model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
        "temperature": 0})
    r.raise_for_status()
    msg = r.json()["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)


def test_dense_prefill_over_cached_chunks(servers, model_path):
    """--hack-prefill dense on a real server whose prompts arrive in 256-token chunks, so each
    chunk reads the earlier ones dequantized: teacher-forced over 900-token essay windows its
    top-1 agrees with BF16 at least as well as the homomorphic server's (prefill reads closer to
    exact; measured 0.88 against 0.78 over 1,670 positions), and it generates from the codes as
    with --hack-prefill homomorphic."""
    hits = {"hack": 0, "dense": 0}
    total = 0
    for i in range(2):
        ids = essay_ids(model_path, 900, index=i)
        ref = _argmax_over(servers["bf16"], ids, 64)
        for name in hits:
            got = _argmax_over(servers[name], ids, 64)
            hits[name] += sum(int(x == y) for x, y in zip(ref, got))
        total += len(ref)
    tf = {name: h / total for name, h in hits.items()}
    print(f"\nteacher-forced top-1 agreement with BF16 over {total} positions: {tf}")
    assert tf["dense"] >= TEACHER_FORCED_MIN
    assert tf["dense"] >= tf["hack"] - DENSE_TF_SLACK, tf
    out = servers["dense"].generate(essay_ids(model_path, 600, index=3), 16)
    assert len(_ids(out)) == 16

