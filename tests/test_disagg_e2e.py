"""Real prefill/decode clusters on this machine: SmolLM2-135M, mooncake over TCP, the PD router,
prefill in its own network namespace behind a tc-shaped veth (root).

Clusters are module-scoped and always torn down (by pid, namespaces removed). Prompts are token
windows of the essays; greedy decoding with a fixed number of new tokens. The radix cache is
off on every server so that PD and colocated runs take the same (cold) prefill path.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import requests

from disagg import cluster, netns, procs
from disagg.replay import generate
from disagg.wire_meter import read_log
from damaged_transfer import check_damaged_request, decode_mismatches
from pd_compare import spawn_colocated, wait_up

pytestmark = [pytest.mark.memory_heavy, pytest.mark.slow, pytest.mark.e2e]

NO_RADIX = ["--disable-radix-cache"]
PAGE = 64
BF16_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # K+V, 30 layers, 3 KV heads, head_dim 64, 2 bytes
WIRE_TOLERANCE = 0.01  # measured bytes vs the layout's prediction (the metadata row is ~1 KB)


def _model() -> str:
    from hack_eval.models import model_dir

    path = model_dir()
    if not path.exists():
        pytest.skip("model not prepared (hack model prepare smollm2)")
    return str(path)


def _prompts(n_tokens: int, count: int, offset: int = 0) -> list[list[int]]:
    from hack_eval.workloads import tokenizer
    from hack_eval.texts import essay_files

    tok = tokenizer(_model())
    ids: list[int] = []
    for p in essay_files():
        ids += tok(p.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) > offset + n_tokens * count:
            break
    return [ids[offset + i * n_tokens: offset + (i + 1) * n_tokens] for i in range(count)]


# Seconds a prefill waits for its decode's handshake (and a decode for a silent prefill). The
# router retries a request whose decode was killed before its health checks notice, and that
# retry's prefill leg waits this long for the dead decode (SGLang's default, 300 s, is the CLI's:
# a loaded decode may pre-allocate late). Requests here are few and short (3,000 tokens at most,
# a prefill of about 7 s here): 30 s is ample.
WAITING_TIMEOUT_S = 30


def _start(request, **kw) -> dict:
    if os.geteuid() != 0 and kw.get("link_mbps"):
        pytest.skip("shaping the link needs root")
    spec = cluster.ClusterSpec(model_path=_model(), max_total_tokens=16384,
                               extra_server_args=NO_RADIX, waiting_timeout_s=WAITING_TIMEOUT_S, **kw)
    state = cluster.up(spec, log=lambda m: None)
    request.addfinalizer(lambda: cluster.down(state))
    return state


def _url(state: dict, role: str) -> str:
    return next(s["url"] for s in state["servers"] if s["role"] == role)


def _pid(state: dict, role: str) -> int:
    return next(int(s["pid"]) for s in state["servers"] if s["role"] == role)


def _kv_usage(url: str) -> dict:
    info = requests.get(f"{url}/server_info", timeout=30).json()
    return info["internal_states"][0]["hack_kv"]


def _wire(state: dict) -> list[dict]:
    return read_log(Path(state["run_dir"]) / "wire-prefill-0.jsonl")


# Memory: a server is ~2.6 GB of processes here, so deployments are started one after the other
# (peak: the HACK pair plus one colocated server) in test order: HACK pair tests first, the
# last of them stops the pair, then the BF16 pair starts.
HACK_WIRE: dict[int, int] = {}  # prompt tokens -> HACK bytes on the wire, for the BF16 comparison


@pytest.fixture(scope="module")
def colocated_spawned(request):
    """The colocated server starts before the HACK pair, so that the two starts overlap instead
    of following each other (each is most of a minute of this machine); the peak stays the pair
    plus one colocated server, which `colocated` stops after its test."""
    return spawn_colocated(_model(), "pd", NO_RADIX, 16384, request)


@pytest.fixture(scope="module")
def hack_pd(request, colocated_spawned):
    return _start(request, kv="hack", link_mbps=1000)


@pytest.fixture(scope="module")
def bf16_pd(request):
    return _start(request, kv="bf16", link_mbps=1000)


@pytest.fixture()
def colocated(request, hack_pd, colocated_spawned):
    pid = colocated_spawned[1]
    request.addfinalizer(lambda: procs.stop(pid))  # after its one test, before the BF16 pair starts
    return wait_up(colocated_spawned)


SAME_TOKEN_LENGTHS = (128, 157)  # a multiple of the partition size and not


def test_pd_hack_gives_the_colocated_greedy_tokens(hack_pd, colocated):
    for n in SAME_TOKEN_LENGTHS:
        prompt = _prompts(n, 1, offset=n)[0]
        pd = generate(hack_pd["router_url"], prompt, 12, stream=False)
        ref = generate(colocated, prompt, 12, stream=False)
        assert pd.ok and ref.ok, (pd.error, ref.error)
        assert pd.output_ids == ref.output_ids, f"{n}-token prompt: PD {pd.output_ids} vs colocated {ref.output_ids}"


def test_pd_timeline_joins_both_roles_with_every_phase(hack_pd):
    """The metrics streams of prefill and decode join into one timeline per request, with the
    fused phases measured on each side (quantization on prefill, approximation on decode)."""
    from hack_metrics.run_view import build_view
    from hack_metrics.runload import RunLoader

    t0 = time.time_ns()
    res = generate(hack_pd["router_url"], _prompts(300, 1, offset=3000)[0], 8, stream=True)
    assert res.ok, res.error
    deadline = time.monotonic() + 30
    while True:
        view = build_view(RunLoader(Path(hack_pd["run_dir"])).load())
        bd = view.breakdown
        mine = bd[(bd["arrival_ns"] >= t0) & (bd["key"] != "room:0")] if len(bd) else bd
        req = view.requests
        done = req[(req["arrival_ns"] >= t0) & (req["key"] != "room:0")] if len(req) else req
        if (len(done) and done["finish_ns"].notna().all()) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert len(mine) == 1, mine
    row, r = mine.iloc[0], done.iloc[0]
    assert {"prefill", "decode"} <= set(str(r["roles"]).split(","))
    for phase in ("prefill", "quantization", "transfer", "approximation", "decode"):
        assert row[phase] > 0, (phase, row.to_dict())
    assert row["jct_s"] == pytest.approx(sum(row[c] for c in ("quantization", "approximation", "dequantization",
                                                               "prefill", "decode", "transfer", "queue", "other")))
    assert 0 < r["ttft_s"] < r["jct_s"] and int(r["output_tokens"]) == 8


def _predicted_hack_bytes(n: int, full_pages: bool = False) -> int:
    """Bytes of an n-token HACK request: with `hack` (--hack-kv-codec hack-pages) the full pages
    without K's code sums and no open page; full_pages: every page as stored (hack-full-pages).
    Each layer in its own layout: the servers' default `--hack-bits auto` loads SmolLM2's shipped
    bit plan (hack_ops/plans/), whose 4-bit layers send 4-bit pages."""
    from hack_ops import HackConfig
    from hack_ops.bit_plan import SHIPPED_DIR, find_plan
    from hack_ops.page_wire import model_request_bytes

    found = find_plan(_model())
    assert found is not None and found[1].parent == SHIPPED_DIR, found
    return model_request_bytes(found[0].apply(HackConfig()), 30, 3, 64, n, hack_pages=not full_pages)


# 2068 = 32 pages + a 20-token open partition (>= 2K tokens, not a multiple of 64)
WIRE_LENGTHS = (157, 2068)


def test_hack_wire_bytes_match_the_compressed_layout(hack_pd):
    for n in WIRE_LENGTHS:
        before = len(_wire(hack_pd))
        h = generate(hack_pd["router_url"], _prompts(n, 1)[0], 2, stream=False)
        assert h.ok, h.error
        recs = _wire(hack_pd)[before:]
        assert len(recs) == 1
        HACK_WIRE[n] = recs[0]["bytes"]
        predicted = _predicted_hack_bytes(n)
        assert abs(HACK_WIRE[n] - predicted) <= WIRE_TOLERANCE * predicted, (n, HACK_WIRE[n], predicted)
        # the transform's saving: at least the open page and the K sums of the run's last page
        full = _predicted_hack_bytes(n, full_pages=True)
        assert HACK_WIRE[n] < full - 0.9 * (full - predicted), (n, HACK_WIRE[n], full)


def test_request_without_bootstrap_fields_gets_400_and_servers_keep_serving(hack_pd):
    for role in ("decode", "prefill"):
        r = requests.post(f"{_url(hack_pd, role)}/generate", timeout=60,
                          json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 400 and "bootstrap_host" in r.text
        assert requests.get(f"{_url(hack_pd, role)}/health", timeout=30).status_code == 200
    ok = generate(hack_pd["router_url"], _prompts(40, 1)[0], 2, stream=False)
    assert ok.ok, ok.error


@pytest.mark.parametrize("kind", ["corrupt", "truncate"])
def test_damaged_transfer_fails_the_request_not_the_server(hack_pd, kind):
    trigger = Path(hack_pd["run_dir"]) / "fault-trigger-decode-0"
    before = decode_mismatches(hack_pd)
    trigger.write_text(kind)
    bad = generate(hack_pd["router_url"], _prompts(150, 1, offset=3000)[0], 4, stream=False)
    assert not trigger.exists(), "the decode server never consumed the fault trigger"
    good = generate(hack_pd["router_url"], _prompts(150, 1, offset=3000)[0], 4, stream=False)
    check_damaged_request(hack_pd, bad, good, before)
    usage = _kv_usage(_url(hack_pd, "decode"))
    assert usage["request_rows_in_use"] == 0 and usage["used_tokens"] == (usage["radix_cached_tokens"] or 0)


def _send_async(url: str, prompt: list[int], n: int) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(generate(url, prompt, n, stream=False, timeout_s=600)))
    t.start()
    return t, out


def test_decode_death_mid_transfer_fails_the_request_and_prefill_frees_its_pages(hack_pd):
    """Last test on the HACK pair: it kills the decode server, then stops the pair."""
    from disagg.bench import set_rate

    link = netns.ShapedLink(hack_pd["link"]["tag"], hack_pd["link"]["subnet_index"], 4)
    set_rate(hack_pd["link"], 4)  # ~2 MB of HACK KV takes ~4 s on the wire
    prompt = _prompts(640, 1, offset=9000)[0]
    start = netns.veth_bytes(link)["rx"]
    t, out = _send_async(hack_pd["router_url"], prompt, 4)
    deadline = time.time() + 300
    while time.time() < deadline and netns.veth_bytes(link)["rx"] - start < 400_000:
        time.sleep(0.1)
    assert netns.veth_bytes(link)["rx"] - start >= 400_000, "the transfer never started"
    procs.kill_hard(_pid(hack_pd, "decode"))
    t.join(400)
    assert not out[0].ok
    prefill_url = _url(hack_pd, "prefill")
    deadline = time.time() + 120
    usage = _kv_usage(prefill_url)
    while time.time() < deadline and usage["request_rows_in_use"]:
        time.sleep(1)
        usage = _kv_usage(prefill_url)
    assert requests.get(f"{prefill_url}/health", timeout=30).status_code == 200
    assert usage["request_rows_in_use"] == 0
    assert usage["used_tokens"] == (usage["radix_cached_tokens"] or 0)
    cluster.down(hack_pd)  # frees its memory before the BF16 pair starts


def test_hack_wire_bytes_are_within_the_bit_plans_budget_of_bf16(bf16_pd):
    """The plain 2-bit format sends ~17% of BF16's bytes; the default's bit plan spends up to its
    budget (20% of BF16's bytes at 4K tokens) on its 4-bit layers, and not more."""
    from hack_ops.bit_plan import find_plan

    budget = find_plan(_model())[0].budget_fraction
    if set(HACK_WIRE) != set(WIRE_LENGTHS):
        pytest.skip("the HACK wire measurement did not run")
    for n in WIRE_LENGTHS:
        before = len(_wire(bf16_pd))
        b = generate(bf16_pd["router_url"], _prompts(n, 1)[0], 2, stream=False)
        assert b.ok, b.error
        recs = _wire(bf16_pd)[before:]
        assert len(recs) == 1
        bf16_bytes = recs[0]["bytes"]
        assert abs(bf16_bytes - -(-n // PAGE) * PAGE * BF16_BYTES_PER_TOKEN) <= WIRE_TOLERANCE * bf16_bytes
        if n >= 2048:
            assert HACK_WIRE[n] <= budget * bf16_bytes, (n, HACK_WIRE[n] / bf16_bytes, budget)


def test_prefill_death_fails_the_waiting_request_and_frees_decode_pages(bf16_pd):
    """Runs on the BF16 pair (the request path on decode does not depend on the KV dtype)."""
    prompt = _prompts(3000, 1, offset=500)[0]
    t, out = _send_async(bf16_pd["router_url"], prompt, 4)
    decode_url = _url(bf16_pd, "decode")
    deadline = time.time() + 120
    while time.time() < deadline and _kv_usage(decode_url)["used_tokens"] == 0:
        time.sleep(0.5)  # decode has pre-allocated the request's pages: prefill is computing
    assert _kv_usage(decode_url)["used_tokens"] > 0
    procs.kill_hard(_pid(bf16_pd, "prefill"))
    t.join(400)
    res = out[0]
    # The router sees the prefill connection die and answers 5xx; had it kept waiting, decode
    # would fail the request itself once its heartbeat to the dead prefill's bootstrap fails.
    assert not res.ok and res.error, "the request must fail"
    assert res.status is None or res.status >= 500, res
    assert requests.get(f"{decode_url}/health", timeout=30).status_code == 200
    deadline = time.time() + 60
    usage = _kv_usage(decode_url)
    while time.time() < deadline and (usage["used_tokens"] or usage["request_rows_in_use"]):
        time.sleep(1)
        usage = _kv_usage(decode_url)
    assert usage["used_tokens"] == 0 and usage["request_rows_in_use"] == 0
