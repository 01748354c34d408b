"""A real Gemma-3-270M server (`hack model prepare gemma3`: 18 layers, 5 of 6 with a 512-token
sliding window, one KV head, head_dim 256, query_pre_attn_scalar scaling) with
`--kv-cache-dtype hack` and the default format (`--hack-bits auto`: the shipped bit plan, some K
and V tensors at 4 bits) next to a BF16 server (torch_native, which applies the same inclusive
window), same fixed KV budget, prompts longer than the window; and a third server with every
layer at 2 bits (`--hack-4bit-layers none`).

The plan's server names its prefill (`--hack-prefill dense`, what `auto` picks on a CPU with
AMX-BF16) so that its bars mean the same on every host; the 2-bit server runs `auto`, whose
choice for this host is checked. On a CPU without AMX `auto` picks the homomorphic prefill,
which loses the recall below: `hack eval recall --model gemma3 --served
hack-dense-prefill,hack-homomorphic-prefill` on an AMD EPYC (no AMX, 2026-11-27) measured 0.90
(dense) against 0.30 (homomorphic) of BF16's continuation (docs/accuracy.md).

Radix-cache state is controlled: every server runs with --disable-radix-cache, so every request
is a cold prefill (cached-prefix and cold prefill are numerically different paths on the CPU;
/flush_cache between requests stalled a --sleep-on-idle server here). Extend over a cached
prefix with windows is checked against the reference in tests/test_window_attention.py.

Two kinds of prompt, because greedy agreement only means something where the reference's own
choice is decisive:
- Essay cuts (640 tokens): open-ended, and BF16's top two first tokens can be tied (0.00 and
  0.12 nat apart on two of four such prompts, 2026-11-25), so even a 4-bit server's greedy
  prefixes were 19, 0, 4 and 0 of 24 there. They carry the teacher-forced bar: top-1 agreement
  with BF16 over the positions after the first window, measured 0.682 over 302 positions
  (2026-11-23); the bar is TEACHER_FORCED_MIN. Their greedy prefixes are printed, not held.
- Recall prompts (hack_eval.workloads.recall_prompt, 824 tokens): an essay passage, 300 tokens of
  another essay, then the passage's first 128 tokens again; the continuation is the passage,
  ~700 tokens back, which only the 3 full-attention layers can read. Of 6 such prompts BF16
  reproduces the passage for all 24 tokens in 4; the greedy bar GREEDY_MIN holds on those 4 for
  the plan's server. Measured there (common prefix with BF16, of 24): every layer at 2 bits 0, 5,
  0, 0 (0.05 of the length: the 2-bit full layers lose the passage); the plan of 2026-11-26 with the dense
  prefill 16, 24, 22, 24 (0.90, 2026-11-27).
The price is capacity: the plan holds fewer tokens than the all-2-bit server in the same budget
(test_capacity_same_budget; docs/engine.md states the target it misses).
"""
from __future__ import annotations

import pytest
import requests

from engine.launcher import SGLangServer
from hack_cli.bench_serve import CAPACITY_TARGET  # x BF16's tokens: met by every layer at 2 bits (x5.37)
from hack_cli.recall_served import recall_rows
from hack_eval.workloads import common_prefix, essay_ids, recall_prompt

pytestmark = [pytest.mark.memory_heavy, pytest.mark.integration, pytest.mark.slow]

BUDGET_MB = "128"
PROMPT_TOKENS = 640  # > the 512-token window: the window layers drop the first 128 keys
N_NEW = 24
N_PROMPTS = 2
N_RECALL = 6
RECALL_DECISIVE_MIN = 3  # prompts where BF16 must reproduce the passage (measured 4 of 6)
STARTUP_TIMEOUT_S = 900.0  # three servers warming up a 270M model on a shared 2-core machine
TEACHER_FORCED_MIN = 0.60
GREEDY_MIN = 0.5
CAPACITY_DEFAULT_MIN = 4.5  # the default, 3 of 18 layers at 4 bits (x4.74): under the target


@pytest.fixture(scope="module")
def model_path() -> str:
    from hack_eval.models import prepare

    return str(prepare("gemma3", log=lambda *a, **k: None))


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gemma3")
    common = ["--hack-kv-budget-mb", BUDGET_MB, "--sleep-on-idle", "--random-seed", "0", "--disable-radix-cache"]
    started = {
        "hack": SGLangServer(model_path, ["--kv-cache-dtype", "hack", "--hack-prefill", "dense", *common],
                             log_path=logs / "hack.log"),
        "hack-2bit": SGLangServer(model_path, ["--kv-cache-dtype", "hack", "--hack-4bit-layers", "none", *common],
                                  log_path=logs / "hack-2bit.log"),
        "bf16": SGLangServer(model_path, ["--attention-backend", "torch_native", *common], log_path=logs / "bf16.log"),
    }
    try:
        for server in started.values():
            server.start()
        for server in started.values():
            server.wait_ready(STARTUP_TIMEOUT_S)
        yield started
    finally:
        for server in started.values():
            server.stop()


def _argmax_over(server: SGLangServer, ids: list[int], start: int) -> list[int]:
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 1,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 1}}
    r = requests.post(server.url + "/generate", json=body, timeout=900)
    r.raise_for_status()
    return [int(t[0][1]) for t in r.json()["meta_info"]["input_top_logprobs"] if t]


def test_capacity_same_budget(servers):
    """Every layer at 2 bits meets the >= 5x target; the default, with its 3 full-attention layers
    at 4 bits, holds fewer tokens (stated above, and in docs/engine.md, as the target it misses)."""
    bf16 = servers["bf16"].kv_usage()["max_total_num_tokens"]
    ratio = {name: servers[name].kv_usage()["max_total_num_tokens"] / bf16 for name in ("hack", "hack-2bit")}
    print(f"\nGemma-3 max total tokens with a {BUDGET_MB} MB KV budget, x BF16's {bf16}: default (auto) "
          f"x{ratio['hack']:.2f}, every layer at 2 bits x{ratio['hack-2bit']:.2f}")
    assert ratio["hack-2bit"] >= CAPACITY_TARGET
    assert CAPACITY_DEFAULT_MIN <= ratio["hack"] < ratio["hack-2bit"]


def test_prefill_auto_is_resolved_at_startup(servers):
    """The 2-bit server runs the default `--hack-prefill auto`; its log names the prefill chosen
    for this host and why (engine.prefill_choice): dense on a CPU with AMX-BF16 or without the
    INT8 kernel's AVX-512 VNNI path, int8 elsewhere."""
    from engine.prefill_choice import cpu_has_amx_bf16, int8_kernel_simd

    log = servers["hack-2bit"].log_path.read_text(errors="replace")
    lines = [ln for ln in log.splitlines() if "HACK prefill attention path:" in ln]
    assert len(lines) == 1 and "[--hack-prefill auto: " in lines[0], lines or log[-2000:]
    if not int8_kernel_simd():
        assert "path: dense (" in lines[0] and "no AVX-512 VNNI" in lines[0], lines[0]
    elif cpu_has_amx_bf16():
        assert "path: dense (" in lines[0] or "which AMX-BF16 does not speed up" in lines[0], lines[0]
    else:
        assert "path: dense (" not in lines[0] and "this CPU has no AMX-BF16" in lines[0], lines[0]
        assert "6-bit codes" in lines[0], lines[0]  # PrefillMode.INT8, the default layout's


def test_teacher_forced_agreement_with_bf16_past_the_window(servers, model_path):
    hack, bf16 = servers["hack"], servers["bf16"]
    prefixes, tf_hits, tf_total = [], 0, 0
    for i in range(N_PROMPTS):
        ids = essay_ids(model_path, PROMPT_TOKENS, index=i)
        ref = list(bf16.generate(ids, N_NEW)["output_ids"])
        got = list(hack.generate(ids, N_NEW)["output_ids"])
        prefixes.append(common_prefix(ref, got))
        full = ids + ref
        a, b = _argmax_over(bf16, full, 512), _argmax_over(hack, full, 512)
        n = min(len(a), len(b))
        assert n >= PROMPT_TOKENS - 512
        tf_hits += sum(int(x == y) for x, y in zip(a[:n], b[:n]))
        tf_total += n
    tf = tf_hits / tf_total
    print(f"\nessay prompts: greedy common prefix (of {N_NEW}) {prefixes} (open-ended, not a bar); "
          f"teacher-forced top-1 agreement past the window over {tf_total} positions: {tf:.3f}")
    assert tf >= TEACHER_FORCED_MIN


def test_greedy_recall_past_the_window(servers, model_path):
    """On the recall prompts where BF16 reproduces the passage, the plan's server (dense
    prefill) agrees with BF16 for at least GREEDY_MIN of the length; the all-2-bit server's
    agreement is measured and printed (0.05)."""
    prompts = [recall_prompt(model_path, i, n_new=N_NEW) for i in range(N_RECALL)]
    assert all(len(p.ids) > 512 and p.distance > 512 for p in prompts)
    names = ("bf16", "hack", "hack-2bit")
    outputs = {n: [list(servers[n].generate(p.ids, N_NEW)["output_ids"]) for p in prompts] for n in names}
    decisive, rows = recall_rows(prompts, outputs, {}, {n: [] for n in names}, N_NEW)  # `hack eval recall`'s measure
    assert len(decisive) >= RECALL_DECISIVE_MIN, f"BF16 reproduced the passage in {decisive} only"
    agree = {r["method"]: r["agreement"] for r in rows}
    for r in rows[1:]:
        print(f"\n{r['method']}: greedy common prefix with BF16 (of {N_NEW}) on the {len(decisive)} recall prompts "
              f"BF16 reproduces: {r['prefixes']} -> {r['agreement']:.2f} of the length (bar {GREEDY_MIN})")
    assert agree["hack"] >= GREEDY_MIN


def test_the_bit_plan_is_loaded_at_startup(servers, model_path):
    """The default `--hack-bits auto` loads Gemma-3-270M's shipped bit plan (hack_ops/plans/), found
    by the model's hash and logged with what it raises; `--hack-4bit-layers none` reads no plan; the
    default's pool costs what the plan's 4-bit pages cost (capacity between the 2-bit pool's and a
    pool with every layer at 4 bits)."""
    from hack_ops.bit_plan import SHIPPED_DIR, find_plan

    plan, where = find_plan(model_path)
    assert where.parent == SHIPPED_DIR
    log = servers["hack"].log_path.read_text(errors="replace")
    assert f"--hack-bits auto = plan {where}" in log and plan.summary() in log, log[-2000:]
    assert "--hack-4bit-layers none = layers none" in servers["hack-2bit"].log_path.read_text(errors="replace")
    layout = servers["hack"].kv_usage()["hack"]["layout"]
    assert layout["layer_bits"] == [4 if i in plan.v_layers else 2 for i in range(18)]
    assert layout.get("layer_k_bits", layout["layer_bits"]) == [4 if i in plan.k_layers else 2 for i in range(18)]
    planned, two = servers["hack"].kv_usage(), servers["hack-2bit"].kv_usage()
    ratio = planned["max_total_num_tokens"] / two["max_total_num_tokens"]
    print(f"\nmax total tokens, {BUDGET_MB} MB: the plan {planned['max_total_num_tokens']}, "
          f"2-bit {two['max_total_num_tokens']} (x{ratio:.3f})")
    assert 0.80 < ratio < 0.99  # a few of 36 K and V tensors with ~1.8x the bytes per page


def test_input_embeds_not_as_wide_as_the_model_get_a_400_and_the_server_serves_on(servers, model_path):
    """These servers run without a radix cache, so SGLang takes input_embeds: a row narrower than
    the hidden size killed the scheduler in its first layer norm (engine.request_checks)."""
    import json
    from pathlib import Path

    width = json.loads((Path(model_path) / "config.json").read_text())["hidden_size"]
    server = servers["hack"]
    url = server.url + "/generate"
    bad = requests.post(url, json={"input_embeds": [[0.0] * 8], "sampling_params": {"max_new_tokens": 2}}, timeout=120)
    assert bad.status_code == 400 and f"this model's embeddings have {width}" in bad.text, bad.text
    good = requests.post(url, json={"input_embeds": [[0.01] * width] * 3, "sampling_params": {"max_new_tokens": 2}},
                         timeout=300)
    assert good.status_code == 200 and good.json()["meta_info"]["completion_tokens"] == 2, good.text[:300]
    assert server.proc.poll() is None
    assert len(server.generate("The capital of France is", 2)["output_ids"]) >= 1
