"""The page tier on real servers (SmolLM2, `--kv-cache-dtype hack --hack-page-tier DIR`): a prompt's
pages written by one server come back, after that server stopped, into a second server on the same
directory (a disk that outlives the server's memory), and its greedy tokens equal the first server's
from its own radix cache (a never-evicted run); SGLang reports the prefix as restored (its
cached_tokens_details.host). A truncated record is refused, the rest of the prompt recomputed, the
request served, and the record written again. A PD prefill server with the tier (`hack up
--page-tier`) restores a flushed prefix and its decode server generates the same tokens. In-process
cases: tests/test_page_tier.py."""
from __future__ import annotations

from array import array
from pathlib import Path

import pytest
import requests

from engine.launcher import SGLangServer
from hack_eval.workloads import essay_ids

pytestmark = [pytest.mark.memory_heavy, pytest.mark.integration, pytest.mark.slow]

PROMPT = 1500  # 23 closed pages (the radix cache keeps whole pages)
N_NEW = 8


@pytest.fixture(scope="module")
def model_path() -> str:
    from hack_eval.models import prepare

    return str(prepare("smollm2", log=lambda *a, **k: None))


def _server(model_path: str, tier: Path) -> SGLangServer:
    return SGLangServer(model_path, ["--kv-cache-dtype", "hack", "--max-total-tokens", "4096",
                                     "--hack-page-tier", str(tier)]).start()


def _generate(url: str, ids: list[int]) -> dict:
    r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": N_NEW, "temperature": 0.0, "ignore_eos": True}}, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def _tier(url: str) -> dict:
    """The page tier's report in a server's /server_info."""
    return requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]["hack_kv"]["page_tier"]


def _page_keys(ids: list[int]) -> list[str]:
    """SGLang's storage keys of the prompt's closed pages (its hash chain, as the tree offloads them)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    n = len(ids) // 64 * 64
    return get_storage_hash_str(RadixKey(token_ids=array("q", ids[:n]), extra_key=None), None, page_size=64)


def _wait_written(url: str, pages: int, files: int | None = None) -> dict:
    """The tier's report once it wrote `pages` pages (and, if given, counts `files` on disk: its
    size on disk is rescanned at most once a second)."""
    import time

    for _ in range(150):
        tier = _tier(url)
        if tier["offloaded_pages"] >= pages and (files is None or tier["files"] == files):
            return tier
        time.sleep(0.2)
    raise AssertionError(f"the tier holds {tier['offloaded_pages']} pages in {tier['files']} files, "
                         f"expected {pages} pages")


def test_pages_outlive_the_server_and_a_truncated_record_is_recomputed(model_path, tmp_path, request):
    tier_dir = tmp_path / "tier"
    prompt = essay_ids(model_path, PROMPT, index=1)
    other = essay_ids(model_path, 1000, index=2)
    pages = PROMPT // 64

    first = _server(model_path, tier_dir)
    request.addfinalizer(first.stop)
    first.wait_ready()
    cold = _generate(first.url, prompt)
    assert cold["meta_info"]["cached_tokens"] == 0
    cached = _generate(first.url, prompt)  # from the pool: the never-evicted run
    assert cached["meta_info"]["cached_tokens"] == pages * 64
    tier = _wait_written(first.url, pages, files=pages + 1)  # the first page's sinks beside it
    assert tier["refused_records"] == 0
    first.stop()
    files = sorted(p.name.split("_")[0] for p in tier_dir.iterdir() if not p.name.startswith("."))
    keys = _page_keys(prompt)
    assert set(keys) <= set(files)

    second = _server(model_path, tier_dir)
    request.addfinalizer(second.stop)
    second.wait_ready()
    back = _generate(second.url, prompt)
    assert back["meta_info"]["cached_tokens"] == pages * 64
    assert back["meta_info"]["cached_tokens_details"]["host"] == pages * 64
    assert back["output_ids"] == cached["output_ids"]
    tier = _tier(second.url)
    assert tier["loaded_pages"] == pages and tier["restored_tokens"] == pages * 64 and tier["refused_records"] == 0

    # a record truncated on disk: the prompt's first two pages come back, the rest is computed
    assert len(_generate(second.url, other)["output_ids"]) == N_NEW
    _wait_written(second.url, len(other) // 64)  # this server's own writes
    second.flush_cache()
    other_keys = _page_keys(other)
    (victim,) = [p for p in tier_dir.iterdir() if p.name.startswith(other_keys[2] + "_")]
    victim.write_bytes(victim.read_bytes()[:1000])
    again = _generate(second.url, other)
    assert len(again["output_ids"]) == N_NEW
    assert again["meta_info"]["cached_tokens"] == 128
    tier = _tier(second.url)
    assert tier["refused_records"] == 1
    # recomputed, the page is offloaded again: whole, and restored on the next miss
    _wait_written(second.url, len(other) // 64 + 1)
    assert victim.exists() and victim.stat().st_size > 1000
    second.flush_cache()
    assert _generate(second.url, other)["meta_info"]["cached_tokens"] == len(other) // 64 * 64
    assert _tier(second.url)["refused_records"] == 1


def test_a_pd_prefill_restores_from_the_tier_and_decode_gets_the_same_tokens(model_path, tmp_path, request):
    """`hack up --page-tier DIR`: the prefill servers get the tier. After both servers flushed their
    caches, the prompt's prefix comes back from disk on the prefill, travels to decode as usual, and
    the greedy tokens equal the run whose prefix the prefill still held."""
    from disagg import cluster
    from disagg.bench import flush_caches
    from disagg.replay import generate

    spec = cluster.ClusterSpec(model_path=model_path, kv="hack", max_total_tokens=4096,
                               page_tier=str(tmp_path / "tier"), health_timeout_s=900.0)
    state = cluster.up(spec, log=lambda m: None)
    request.addfinalizer(lambda: cluster.down(state))
    prefill = next(s["url"] for s in state["servers"] if s["role"] == "prefill")
    prompt = essay_ids(model_path, PROMPT, index=3)
    pages = PROMPT // 64
    assert generate(state["router_url"], prompt, N_NEW, stream=False).ok
    cached = generate(state["router_url"], prompt, N_NEW, stream=False)  # the prefill's own radix cache
    assert cached.ok and len(cached.output_ids) == N_NEW

    _wait_written(prefill, pages)
    # A server refuses a flush while a PD transfer or bootstrap is still settling after the last
    # request: wait it out as the benchmarks do.
    flush_caches(state)
    back = generate(state["router_url"], prompt, N_NEW, stream=False)
    assert back.ok and back.output_ids == cached.output_ids
    t = _tier(prefill)
    assert t["loaded_pages"] == pages and t["refused_records"] == 0
    cluster.down(state)
