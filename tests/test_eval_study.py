"""The accuracy study's code path on a few tokens of the real model, the size table, and the
model cache's verification."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from hack_eval.accuracy import edit_similarity, run_study
from hack_eval.models import MANIFEST, _verify_folder, prepare
from hack_eval.report import choose_default, render
from hack_eval.size import size_table


def test_edit_similarity():
    assert edit_similarity("abc", "abc") == 1.0
    assert edit_similarity("", "") == 1.0
    assert edit_similarity("abc", "") == 0.0
    assert edit_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)


def test_prepared_model_verifies_and_detects_tampering(tmp_path):
    folder = prepare()
    assert _verify_folder(folder)
    copy = tmp_path / "m"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("model.safetensors"))
    (copy / "model.safetensors").symlink_to(folder / "model.safetensors")
    assert _verify_folder(copy)
    cfg = copy / "config.json"
    cfg.write_text(cfg.read_text().replace('"num_hidden_layers": 30', '"num_hidden_layers": 29'))
    assert not _verify_folder(copy)
    (copy / MANIFEST).unlink()
    assert not _verify_folder(copy)


def test_size_table_matches_layout():
    rows = size_table("smollm2", 2048)
    assert rows[0]["format"] == "bf16" and rows[0]["bytes_per_token_layer"] == 2 * 2 * 3 * 64
    default = next(r for r in rows if r["format"].startswith("hack default channel_k"))
    assert 0.16 < default["ratio"] <= 0.18  # the byte budget the defaults were chosen under


def test_cli_size_json():
    out = subprocess.run([sys.executable, "-m", "hack_cli.main", "eval", "size", "--json"],
                         capture_output=True, text=True, timeout=120, check=True)
    rows = json.loads(out.stdout)
    assert rows[0]["format"] == "bf16" and all(0 < r["ratio"] <= 1 for r in rows)


def test_variants_filter_selects_rows_and_refuses_unknown_patterns():
    from hack_eval.runner import EXACT
    from hack_eval.variants import select_variants, study_variants

    picked = select_variants(study_variants(), ["rotation"])
    assert picked[0] is EXACT and len(picked) > 2
    assert all("rotation" in v.name and v.config.rotation != "none" for v in picked[1:])
    both = select_variants(study_variants(), ["ROT-hadamard_v", " 4-bit"])  # labels too, case-insensitive
    assert {v.config.rotation.value for v in both[1:] if v.config.kv_bits == 2} == {"hadamard_v"}
    assert any(v.config.kv_bits == 4 for v in both[1:])
    exact_name = select_variants(study_variants(), ["=default"])
    assert [(v.name, v.mode) for v in exact_name[1:]] == [("default", "hack"), ("default", "dequant")]
    with pytest.raises(ValueError, match="matches no variant"):
        select_variants(study_variants(), ["rotation", "givens"])
    with pytest.raises(ValueError, match="replaces --quick/--core"):
        run_study(core=True, variant_patterns=["rotation"], log=lambda m: None)


@pytest.mark.slow
def test_quick_study_on_the_real_model():
    res = run_study(context=96, essays=1, plays=1, gen_prompts=1, gen_tokens=4, quick=True, log=lambda m: None)
    rows = {(r["mode"], r["variant"]): r for r in res["rows"]}
    exact = rows[("exact", "exact")]
    assert exact["ppl_ratio"] == pytest.approx(1.0) and exact["kl"] == pytest.approx(0.0, abs=1e-6)
    assert exact["top1"] == 1.0
    hack = rows[("hack", "default")]
    # 96 tokens: 1 closed page of 64, the rest FP16; the model must be near, not equal.
    assert 1.0 < hack["ppl_ratio"] < 2.0 and 0 < hack["kl"] < 1.0 and 0.5 < hack["top1"] < 1.0
    assert hack["edit_similarity"] is not None and 0.0 <= hack["edit_similarity"] <= 1.0
    paper = rows[("dequant", "paper layout")]
    assert paper["kl"] > hack["kl"]  # the paper's per-token K is far worse on this model
    assert res["predicted_tokens"] == 2 * 95
    text = render(res, "hack eval accuracy --quick")
    assert "| default | hack |" in text and "hack eval accuracy --quick" in text
    assert choose_default(res["rows"]) is None or choose_default(res["rows"])["config"]
