"""The lossless transfer codec on real servers: a 1P1D bf16-lossless pair (SmolLM2-135M,
mooncake over TCP, prefill behind a 1000 Mbit/s shaped link, root) started once for the module.

- greedy tokens equal a BF16 server's, and fewer bytes cross the link than BF16 would send;
- a corrupted coded page fails its request with the digest error, pages are freed, the next
  request succeeds;
- a prefill without the codec is refused by the codec decode with the mismatch sentence.
Radix caches are off so every run takes the same cold prefill path.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import requests

from disagg import cluster
from damaged_transfer import check_damaged_request, decode_mismatches
from pd_compare import Spawned, spawn_server, wait_up
from disagg.replay import generate
from disagg.wire_meter import read_log
from engine.launcher import free_port

pytestmark = [pytest.mark.memory_heavy, pytest.mark.slow, pytest.mark.e2e]

NO_RADIX = ["--disable-radix-cache"]
PAGE = 64
BF16_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # K+V, 30 layers, 3 KV heads, head_dim 64, 2 bytes
MAX_CODED_SHARE = 0.78  # the target for coded BF16 KV, header rows and metadata included


def _model() -> str:
    from hack_eval.models import model_dir

    path = model_dir()
    if not path.exists():
        pytest.skip("model not prepared (hack model prepare smollm2)")
    return str(path)


def _prompt(n_tokens: int, offset: int) -> list[int]:
    from hack_eval.workloads import tokenizer
    from hack_eval.texts import essay_files

    tok = tokenizer(_model())
    ids: list[int] = []
    for p in essay_files():
        ids += tok(p.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) > offset + n_tokens:
            break
    return ids[offset:offset + n_tokens]


def _spawn(request, role: str, method: str, bootstrap_port: int | None = None) -> Spawned:
    return spawn_server(_model(), "codec", role, method, NO_RADIX, 16384, request, bootstrap_port,
                        env={"SGLANG_HOST_IP": "127.0.0.1"})


@pytest.fixture(scope="module")
def others(request) -> dict:
    """The colocated BF16 reference and a prefill without the codec, started with the cluster so
    that the four starts overlap (idle servers sleep: the tests' requests run alone)."""
    if os.geteuid() != 0:
        pytest.skip("shaping the link needs root")
    bport = free_port()
    return {"bf16": _spawn(request, "colocated", "bf16"),
            "plain_prefill": _spawn(request, "prefill", "bf16", bootstrap_port=bport), "bootstrap_port": bport}


@pytest.fixture(scope="module")
def lossless_pd(request, others):
    spec = cluster.ClusterSpec(model_path=_model(), kv="bf16-lossless", max_total_tokens=16384,
                               extra_server_args=NO_RADIX, waiting_timeout_s=300, link_mbps=1000)
    state = cluster.up(spec, log=lambda m: None)
    request.addfinalizer(lambda: cluster.down(state))
    return state


def _url(state: dict, role: str) -> str:
    return next(s["url"] for s in state["servers"] if s["role"] == role)


def _decode_usage(state: dict) -> dict:
    info = requests.get(f"{_url(state, 'decode')}/server_info", timeout=30).json()
    return info["internal_states"][0]["hack_kv"]


def test_lossless_pair_gives_the_bf16_tokens_with_fewer_bytes(lossless_pd, others):
    bf16 = wait_up(others["bf16"])
    wire = Path(lossless_pd["run_dir"]) / "wire-prefill-0.jsonl"
    for n, offset in ((157, 157), (2068, 0)):
        prompt = _prompt(n, offset)
        before = len(read_log(wire))
        pd = generate(lossless_pd["router_url"], prompt, 12, stream=False)
        ref = generate(bf16, prompt, 12, stream=False)
        assert pd.ok and ref.ok, (pd.error, ref.error)
        assert pd.output_ids == ref.output_ids, f"{n}-token prompt: PD {pd.output_ids} vs BF16 {ref.output_ids}"
        recs = read_log(wire)[before:]
        assert len(recs) == 1
        raw = -(-n // PAGE) * PAGE * BF16_BYTES_PER_TOKEN  # what the BF16 pair sends (docs/disagg.md)
        assert recs[0]["bytes"] <= MAX_CODED_SHARE * raw, (n, recs[0]["bytes"] / raw)


def test_corrupted_coded_bytes_fail_the_request_and_free_its_pages(lossless_pd):
    trigger = Path(lossless_pd["run_dir"]) / "fault-trigger-decode-0"
    prompt = _prompt(150, 3000)
    before = decode_mismatches(lossless_pd)
    trigger.write_text("corrupt")
    bad = generate(lossless_pd["router_url"], prompt, 4, stream=False)
    assert not trigger.exists(), "the decode server never consumed the fault trigger"
    good = generate(lossless_pd["router_url"], prompt, 4, stream=False)
    check_damaged_request(lossless_pd, bad, good, before)
    usage = _decode_usage(lossless_pd)
    assert usage["request_rows_in_use"] == 0 and usage["used_tokens"] == (usage["radix_cached_tokens"] or 0)


def test_prefill_without_the_codec_is_refused_with_a_sentence(lossless_pd, others):
    wait_up(others["plain_prefill"])
    bport = others["bootstrap_port"]
    body = {"input_ids": _prompt(40, 500), "sampling_params": {"max_new_tokens": 2, "temperature": 0.0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": random.getrandbits(62)}
    r = requests.post(f"{_url(lossless_pd, 'decode')}/generate", json=body, timeout=300)
    assert r.status_code >= 400, r.text
    assert "prefill uses no KV transfer codec, decode uses KV transfer codec splitzip" in r.text, r.text
    ok = generate(lossless_pd["router_url"], _prompt(40, 600), 2, stream=False)
    assert ok.ok, ok.error
