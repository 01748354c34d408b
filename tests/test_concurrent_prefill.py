"""Concurrent long prompts through a real server in every prefill mode: chunked prefill batches a
cold prompt with the next chunk of one over its cached prefix (and, with --enable-mixed-chunk,
with requests at their decode steps). Such a batch once killed the `--hack-prefill dense`
server (the prefill `auto` picks on CPUs with AMX-BF16 and on GPUs) and the dequantizing
strawman's: torch's CPU flash kernel was called over the cold prompt's zero prefix keys and
died with SIGFPE (tests/test_mixed_batches.py holds the kernel-level cases).

Each server takes four prompts at once whose lengths are not multiples of the chunk size, so
the last chunk of one prompt shares its batch with the first of the next; answers are checked
against the same prompts sent one at a time, the server must still serve afterwards and its
pool must come back to idle. One server per mode, started two at a time (two starts overlap on
this machine's two cores; the second sleeps while the first is tested) and each stopped after its
test, so at most two hold memory.
"""
from __future__ import annotations

import threading
import time

import pytest

from engine.launcher import SGLangServer
from hack_eval.workloads import common_prefix, essay_ids

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHUNK = 384  # --chunked-prefill-size: every prompt below spans 2-4 chunks
LENGTHS = (1100, 900, 700, 500)  # none a multiple of CHUNK
NEW_TOKENS = 10
IDLE_TIMEOUT_S = 60.0
# (name, server flags): every PrefillMode the kernels take ('auto' resolves to one of them at
# startup, tests/test_prefill_choice.py), and the dequantizing strawman, whose prefill is the
# dense one. --enable-mixed-chunk puts running requests' decode steps into the prefill batches.
SERVERS = [
    ("homomorphic", ["--hack-prefill", "homomorphic"]),
    ("int8", ["--hack-prefill", "int8"]),
    ("exact", ["--hack-prefill", "exact"]),
    ("dense-mixed-chunk", ["--hack-prefill", "dense", "--enable-mixed-chunk"]),
    ("dequant", ["--hack-attention", "dequant"]),
]


@pytest.fixture(scope="module")
def model_path() -> str:
    from hack_eval.models import prepare

    return str(prepare("smollm2", log=lambda *a, **k: None))


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory):
    """servers(name): the started server of mode `name`; the first ask of a pair stops the pair
    before and starts both."""
    logs = tmp_path_factory.mktemp("concurrent-prefill")
    names = [name for name, _ in SERVERS]
    started: dict[str, SGLangServer] = {}

    def get(name: str) -> SGLangServer:
        if name not in started:
            i = names.index(name)
            # The pair asked for before is done with (the tests ask in SERVERS' order): stopped,
            # two servers at most are alive (tests/conftest.py: memory-heavy modules).
            for done in list(started):
                started.pop(done).stop()
            for n, flags in SERVERS[i - i % 2: i - i % 2 + 2]:
                # a fixed KV budget, not a fraction of the host's memory: SGLang's profile counts the
                # other server of the pair against the fraction (with float32 weights, on a CPU
                # without BF16 arithmetic, 0.1 left the second server no KV memory)
                started[n] = SGLangServer(model_path, ["--kv-cache-dtype", "hack", *flags, "--chunked-prefill-size",
                                                       str(CHUNK), "--hack-kv-budget-mb", "256", "--random-seed",
                                                       "0", "--sleep-on-idle"], log_path=logs / f"{n}.log").start()
        return started[name].wait_ready()

    try:
        yield get
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def prompts(model_path) -> list[list[int]]:
    return [essay_ids(model_path, n, index=i) for i, n in enumerate(LENGTHS)]


def _wait_idle(server: SGLangServer, timeout: float = IDLE_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout
    usage = server.kv_usage()
    while time.monotonic() < deadline:
        usage = server.kv_usage()
        if usage["request_rows_in_use"] == 0 and usage["used_tokens"] == usage["radix_cached_tokens"]:
            return usage
        time.sleep(0.5)
    raise AssertionError(f"KV memory did not return to idle within {timeout}s: {usage}")


def _concurrently(server: SGLangServer, prompts: list[list[int]]) -> tuple[dict[int, dict], list[BaseException]]:
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = server.generate(prompts[i], NEW_TOKENS, timeout=600, ignore_eos=True)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    return results, errors


@pytest.mark.parametrize("name,flags", SERVERS, ids=[s[0] for s in SERVERS])
def test_concurrent_long_prompts_in_every_prefill_mode(name, flags, servers, prompts):
    server = servers(name)
    try:
        results, errors = _concurrently(server, prompts)
        assert server.proc.poll() is None, f"the {name} server died:\n{server.log_tail(60)}"
        assert not errors, (errors, server.log_tail(30))
        assert sorted(results) == list(range(len(prompts)))
        _wait_idle(server)
        server.flush_cache()
        solo = [list(server.generate(p, NEW_TOKENS, ignore_eos=True)["output_ids"]) for p in prompts]
        same = []
        for i, p in enumerate(prompts):
            meta = results[i]["meta_info"]
            assert meta["prompt_tokens"] == len(p) and meta["completion_tokens"] == NEW_TOKENS, meta
            assert len(results[i]["output_ids"]) == NEW_TOKENS
            same.append(common_prefix(solo[i], list(results[i]["output_ids"])))
        print(f"\n{name}: batched vs one-at-a-time common prefix (of {NEW_TOKENS}): {same}")
        # Batching moves chunk boundaries (which tokens a chunk reads dequantized or at full
        # precision in 'dense'/'exact') and the model's batched matmuls' summation order, so a
        # greedy continuation may part at a near tie (the dense prefill's first-token logprobs
        # move by up to 0.04 nat with the chunking); at least half agree from the first token.
        assert sum(s >= 1 for s in same) >= len(prompts) // 2, same
        # still serving, and the pool back to idle
        assert len(server.generate("The capital of France is", 3)["output_ids"]) >= 1
        server.flush_cache()
        usage = _wait_idle(server)
        assert usage["used_tokens"] == 0 and usage["request_rows_in_use"] == 0
    finally:
        server.stop()
