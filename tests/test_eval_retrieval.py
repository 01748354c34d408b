"""Passkey retrieval (`hack eval retrieval`): the items' construction, the teacher-forced score
against real greedy decoding on the real model, and the command end to end on a short context."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hack_eval.models import prepare
from hack_eval.retrieval import build_items


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(prepare(log=lambda m: None)))


def test_items_have_the_asked_length_key_and_depth(tok):
    items = build_items(tok, [256, 1024], per_cell=5, seed=3)
    assert [it.context for it in items] == [256] * 5 + [1024] * 5
    for it in items:
        assert len(it.ids) == it.context
        answer = tok.decode(list(it.ids[it.answer_start:]))
        assert answer.strip() == it.key and len(it.key) == 5
        prompt = tok.decode(list(it.ids[:it.answer_start]))
        assert prompt.count(it.key) == 2 and prompt.rstrip().endswith("The pass key is")
        # The needle sits at its depth of the haystack (intro and question excluded), within 10%.
        at = prompt.index(f"The pass key is {it.key}") / len(prompt)
        assert abs(at - it.depth) < 0.1, (at, it.depth)
        needle = tok.decode(list(it.ids[it.needle_start:it.needle_start + it.needle_len]))
        assert needle.strip() == f"The pass key is {it.key}. Remember it. {it.key} is the pass key."
    assert [it.depth for it in items[:5]] == [0.1, 0.3, 0.5, 0.7, 0.9]
    again = build_items(tok, [256, 1024], per_cell=5, seed=3)
    assert again == items  # seeded
    assert build_items(tok, [256], per_cell=5, seed=4) != items[:5]
    assert len({it.ids[10:60] for it in items}) > 1  # haystacks differ between items
    # one seeded sequence over the contexts in order: a later context's items are not a run of
    # that context alone (the report says so, and the digests tell them apart)
    assert build_items(tok, [1024], per_cell=5, seed=3) != items[5:]


def test_items_digest_tells_runs_apart_exactly(tok):
    from hack_eval.retrieval import items_digest

    items = build_items(tok, [256, 1024], per_cell=5, seed=3)
    digest = items_digest(items)
    assert list(digest) == ["256", "1024"] and all(len(d) == 12 for d in digest.values())
    assert items_digest(build_items(tok, [256, 1024], per_cell=5, seed=3)) == digest  # same settings, same hash
    assert items_digest(build_items(tok, [256, 1024], per_cell=5, seed=4))["256"] != digest["256"]
    assert items_digest(build_items(tok, [1024], per_cell=5, seed=3))["1024"] != digest["1024"]
    # the hash follows the tokens, not the settings: the same items, however built, hash alike
    assert items_digest(items[:5]) == {"256": digest["256"]}
    # the haystacks are drawn from as much essay text as the longest context asks: a longer list can
    # move even the first context's items (a run of 256 alone against 256 beside a far longer one)
    far = build_items(tok, [256, 60_000], per_cell=5, seed=3)
    alone = build_items(tok, [256], per_cell=5, seed=3)
    assert [it.key for it in far[:5]] == [it.key for it in alone[:5]]  # the keys are drawn alike
    assert items_digest(far)["256"] != items_digest(alone)["256"]


def test_the_report_says_how_items_follow_the_contexts():
    from hack_eval.retrieval import render_retrieval

    res = {"model": "m", "items_per_context": 2, "seed": 0, "depths": [0.5], "served": False, "rows": []}
    note = "items are another run's only where the contexts before it and the longest context were the same"
    assert note in render_retrieval({**res, "contexts": [256, 1024]}, "cmd")
    assert note in render_retrieval({**res, "contexts": [1024]}, "cmd")
    digested = render_retrieval({**res, "contexts": [256, 1024], "items_digest": {"256": "ab12", "1024": "cd34"}},
                                "cmd")
    assert "256 `ab12`, 1024 `cd34`" in digested


def test_too_short_a_context_is_refused(tok):
    with pytest.raises(ValueError, match="too short"):
        build_items(tok, [40], per_cell=1)
    with pytest.raises(ValueError, match="at least one item"):
        build_items(tok, [256], per_cell=0)


@pytest.mark.slow
def test_teacher_forced_score_equals_greedy_decoding():
    """answered() claims greedy decoding reproduces the key exactly; check it against
    model.generate for exact and the homomorphic default on the same items."""
    from hack_eval.retrieval import answered
    from hack_eval.runner import EXACT, greedy, load_model
    from hack_eval.variants import select_variants, study_variants

    model, tok_ = load_model(prepare(log=lambda m: None), threads=2)
    hack = next(v for v in select_variants(study_variants(), ["=default"]) if str(v.mode) == "hack")
    items = build_items(tok_, [256], per_cell=3, seed=0)
    exact_hits = 0
    for it in items:
        want = list(it.ids[it.answer_start:])
        for v in (EXACT, hack):
            got = greedy(model, list(it.ids[:it.answer_start]), v, len(want))
            assert answered(model, it, v) == (got == want), (it.depth, v.name, tok_.decode(got))
            exact_hits += v is EXACT and got == want
    assert exact_hits == len(items)  # the exact model finds every key at 256 tokens (measured: 5 of 5)


@pytest.mark.slow
def test_needle_attention_finds_the_heads_that_copy_the_key():
    """On the exact model at 256 tokens (where it finds every key): some layer's head puts most
    of the answer positions' attention on the 19-token needle sentence, far above its share of
    the prompt; every mass is a probability mass."""
    from hack_eval.retrieval import needle_attention
    from hack_eval.runner import load_model

    model, tok_ = load_model(prepare(log=lambda m: None), threads=2)
    items = build_items(tok_, [256], per_cell=2, seed=0)
    rows = needle_attention(model, items, log=lambda m: None)
    assert [r["layer"] for r in rows] == list(range(30))
    assert all(0 <= r["mean_mass"] <= r["max_head_mass"] <= 1 + 1e-5 for r in rows)
    share = items[0].needle_len / items[0].answer_start
    top = max(r["max_head_mass"] for r in rows)
    assert top > 0.5 and top > 4 * share, (top, share)  # measured: 0.95 (layer 21) against a share of 0.11


@pytest.mark.slow
def test_cli_writes_report_and_json(tmp_path, tok):
    from hack_eval.retrieval import items_digest

    out, js = tmp_path / "r.md", tmp_path / "r.json"
    subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "retrieval", "--contexts", "128",
                    "--items", "2", "--threads", "2", "--needle-attention", "--4bit-layers", "1,2",
                    "--out", str(out), "--json-out", str(js)],
                   capture_output=True, text=True, timeout=900, check=True)
    res = json.loads(js.read_text())
    assert [(r["variant"], r["mode"]) for r in res["rows"]] == [
        ("exact", "exact"), ("default", "hack"), ("default", "dequant"),
        ("default, layers 1,2 at 4 bits", "hack"), ("default, layers 1,2 at 4 bits", "dequant")]
    assert res["four_bit_layers"] == [1, 2] and len(res["needle_attention"]) == 30
    assert "Where the exact model looks for the key" in out.read_text()
    assert all(r["items"] == 2 and 0 <= r["accuracy"] <= 1 and r["context"] == 128 for r in res["rows"])
    text = out.read_text()
    assert "hack eval retrieval --contexts 128 --items 2 --threads 2" in text and "| default | hack |" in text
    # the run records which questions it asked; --items-digest prints the same hash without a model
    digest = items_digest(build_items(tok, [128], per_cell=2, seed=0))
    assert res["items_digest"] == digest and f"128 `{digest['128']}`" in text
    only = subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "retrieval", "--contexts", "128",
                           "--items", "2", "--items-digest"], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(only.stdout) == digest
    bad = subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "retrieval", "--contexts", "16"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "at least 64 tokens" in bad.stderr


def test_served_rows_count_per_context_and_depth():
    from hack_eval.retrieval import Item
    from hack_cli.retrieval_served import served_rows

    items = [Item(c, d, "12345", (1, 2, 3), 2) for c in (256, 512) for d in (0.1, 0.5, 0.1)]
    answers = [True, False, False, True, True, True]
    rows = served_rows("hack", ["--kv-cache-dtype", "hack"], items, answers, seconds=12.0)
    assert [(r["context"], r["items"], r["mode"], r["config"]) for r in rows] == [
        (256, 3, "served", "--kv-cache-dtype hack"), (512, 3, "served", "--kv-cache-dtype hack")]
    assert rows[0]["accuracy"] == pytest.approx(1 / 3) and rows[0]["by_depth"] == {"0.1": 0.5, "0.5": 0.0}
    assert rows[1]["accuracy"] == 1.0 and rows[1]["seconds"] == pytest.approx(6.0)


def test_served_retrieval_refuses_bad_methods_before_starting_servers():
    from hack_cli.retrieval_served import run_served_retrieval

    with pytest.raises(ValueError, match="--served takes methods"):
        run_served_retrieval("smollm2", [256], 1, ["bf16", "int3"])
    with pytest.raises(ValueError, match="needs --4bit-layers"):
        run_served_retrieval("smollm2", [256], 1, ["hack-4bit-layers"])


@pytest.mark.slow
def test_cli_served_asks_real_servers(tmp_path):
    """--served: one real server per method answers the same items; the BF16 server finds the
    keys of short documents (as the exact model does), and the rows name each server's options."""
    js = tmp_path / "s.json"
    subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "retrieval", "--contexts", "256", "--items", "2",
                    "--served", "bf16,hack-4bit-layers", "--4bit-layers", "1,2", "--out", "",
                    "--json-out", str(js)], capture_output=True, text=True, timeout=900, check=True)
    res = json.loads(js.read_text())
    assert res["served"] and res["four_bit_layers"] == [1, 2] and list(res["items_digest"]) == ["256"]
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"bf16", "hack-4bit-layers"} and all(r["items"] == 2 for r in rows.values())
    assert rows["hack-4bit-layers"]["config"] == "--kv-cache-dtype hack --hack-4bit-layers 1,2"
    assert rows["bf16"]["accuracy"] == 1.0


def test_served_contexts_past_the_models_length_are_refused_before_any_server():
    from hack_cli.retrieval_served import context_limit, run_served_retrieval

    assert context_limit(prepare(log=lambda m: None)) == 8192  # SmolLM2
    with pytest.raises(ValueError, match="context length of 8192 tokens"):
        run_served_retrieval("smollm2", [4096, 8192], 1, ["hack"], log=lambda m: None)


@pytest.mark.slow
def test_cli_static_eviction_rows(tmp_path):
    """--bits-plan --static-keep: the calibrated plan's 'dequant' row, then the same under static
    eviction per unit; each static row reads about half of the prompt's closed pages and puts
    fewer bytes on the wire than all of them (the page unit no more than the head unit)."""
    js = tmp_path / "s.json"
    subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "retrieval", "--contexts", "768", "--items", "1",
                    "--threads", "2", "--bits-plan", "--modes", "dequant", "--static-keep", "0.5",
                    "--static-unit", "page,head", "--out", "", "--json-out", str(js)],
                   capture_output=True, text=True, timeout=900, check=True)
    rows = json.loads(js.read_text())["rows"]
    assert [r["variant"] for r in rows] == [
        "exact", "default, calibrated bit plan", "default, calibrated bit plan, static keep 0.5 (page)",
        "default, calibrated bit plan, static keep 0.5 (head)"]
    page, head = rows[2]["static"], rows[3]["static"]
    for st in (page, head):
        # ~11 closed pages of the prompt: 6 kept, page 0 among them (the 8 observed rows are in the open page)
        assert st["pages_read"] == pytest.approx(6 / 11) and st["layers_evicting"] == 30
        assert st["wire_vs_bf16"] < st["wire_all_pages_vs_bf16"] < 0.3 and 0 <= st["needle_kept"] <= 1
        assert 0.5 < st["slots_needed"] <= 1
    assert page["wire_vs_bf16"] <= head["wire_vs_bf16"]
    assert page["wire_vs_all_pages"] < 0.75


@pytest.mark.parametrize("flags, message", [
    (["--static-keep", "1.0"], "strictly between 0 and 1"),
    (["--static-keep", "half"], "comma-separated fractions"),
    (["--static-keep", "0.5", "--static-unit", "token"], "--static-unit takes"),
    (["--static-unit", "head"], "give --static-keep too"),
    (["--static-keep", "0.5", "--served", "hack"], "--served measures servers"),
    (["--bits-plan", "--variants", "paper"], "--bits-plan scores its own"),
    (["--static-keep", "0.5", "--modes", "hack"], "'dequant' rows"),
])
def test_cli_static_flags_are_checked(flags, message):
    bad = subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "retrieval", "--contexts", "256",
                          "--items", "1", *flags], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and message in bad.stderr, bad.stderr[-500:]


def test_accuracy_bits_plan_refuses_other_row_choices():
    bad = subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "accuracy", "--bits-plan", "--4bit-layers",
                          "1,2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--bits-plan scores its own three rows" in bad.stderr, bad.stderr[-500:]


def test_accuracy_bits_plan_sparse_rows_read_the_plan():
    """--bits-plan --sparse-budgets: the sparse rows take the plan's format (its 4-bit layers),
    in the modes asked, refined too; a refinement without budgets is still refused."""
    from hack_cli.cmd_eval import _plan_variants

    rows = _plan_variants("smollm2", ["dequant"], sparse_budgets=(1024,), sparse_refine=2)
    plan = [r for r in rows if r.name == "default, calibrated bit plan"][0]
    sparse = [r for r in rows if r.sparse is not None]
    assert [r.name for r in sparse] == ["default, calibrated bit plan, sparse decode 1024 tokens",
                                        "default, calibrated bit plan, sparse decode 1024 tokens, refine 2"]
    assert all(r.config == plan.config and r.mode == plan.mode == "dequant" for r in sparse)
    assert plan.config.four_bit_layers or plan.config.label() != "channel_k-P64-2bit-sink1"
    assert [r.sparse.refine for r in sparse] == [1, 2] and all(r.sparse.budget_tokens == 1024 for r in sparse)
    bad = subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "accuracy", "--bits-plan", "--sparse-refine",
                          "2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "give --sparse-budgets too" in bad.stderr, bad.stderr[-500:]


def test_accuracy_plan_files_add_rows_for_the_same_model_only():
    """--bits-plan --plan-file: a row for the file's plan next to the shipped one; a plan measured on
    other weights is refused with both hashes; --plan-file without --bits-plan is refused."""
    from hack_cli.cmd_eval import _plan_variants

    root = Path(__file__).resolve().parents[1] / "docs" / "study" / "plans"
    rows = _plan_variants("smollm2", ["dequant"], plan_files=[str(root / "smollm2-2026-11-26.json")])
    old = [r for r in rows if r.name == "default, bit plan smollm2-2026-11-26.json"]
    assert len(old) == 1 and old[0].mode == "dequant"
    assert old[0].config.four_bit_k_layers == (4, 5, 7, 8, 10, 17, 18, 23)  # the file's plan, not the shipped one
    with pytest.raises(ValueError, match="was measured for model"):
        _plan_variants("smollm2", ["dequant"], plan_files=[str(root / "gemma3-2026-11-26.json")])
    bad = subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "accuracy", "--plan-file",
                          str(root / "smollm2-2026-11-26.json")], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "give --bits-plan too" in bad.stderr, bad.stderr[-500:]
