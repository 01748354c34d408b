"""`--hack-sparse-score auto` (the default): the page score chosen at startup from the served
model's head width (engine.sparse_choice), published as a plain score, logged with its reason;
a score or refinement given by hand is kept; nothing is chosen while sparse decode is off."""
from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from engine import cpu_runtime  # noqa: E402

cpu_runtime.prepare()

from transformers import LlamaConfig  # noqa: E402

from engine import settings as settings_mod  # noqa: E402
from engine.sparse_choice import (LINEAR_FROM_HEAD_DIM, SMALL_BUDGET_REFINE, SMALL_BUDGET_TOKENS,  # noqa: E402
                                  WIDE_HEAD_REFINE, choose)
from engine.server_options import apply_cli_namespace  # noqa: E402
from hack_ops.sparse import PageScore, SparseConfig  # noqa: E402


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(settings_mod.ENV_VAR, raising=False)


def _llama(folder, head_dim: int) -> str:
    """A model folder holding only a Llama config with heads of `head_dim` channels."""
    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=head_dim, intermediate_size=64, vocab_size=128)
    cfg.architectures = ["LlamaForCausalLM"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    return str(folder)


def test_the_rule_by_head_width():
    assert choose(64, on_gpu=False, refine_given=False).score == PageScore.BOUND
    assert choose(64, False, False).refine is None
    c128 = choose(128, False, False)
    assert c128.score == PageScore.BOUND and "not measured" in c128.reason
    wide = choose(LINEAR_FROM_HEAD_DIM, False, False)
    assert (wide.score, wide.refine) == (PageScore.LINEAR, WIDE_HEAD_REFINE) and "Gemma-3" in wide.reason
    # budgets up to 2K take the larger refinement on wide heads; narrow heads none at any budget
    assert SMALL_BUDGET_TOKENS == 2048
    assert choose(256, False, False, budget=SMALL_BUDGET_TOKENS).refine == SMALL_BUDGET_REFINE
    assert choose(256, False, False, budget=1024).refine == SMALL_BUDGET_REFINE
    assert choose(256, False, False, budget=SMALL_BUDGET_TOKENS + 16).refine == WIDE_HEAD_REFINE
    assert choose(256, False, False, budget=4096).refine == WIDE_HEAD_REFINE
    assert choose(64, False, False, budget=512).refine is None
    assert choose(256, on_gpu=True, refine_given=False).refine is None  # the GPU selection has no refinement
    assert choose(256, True, False, budget=512).refine is None
    assert choose(256, False, True, budget=512).refine is None
    assert choose(256, False, refine_given=True).refine is None  # a refinement given by hand stays
    assert choose(None, False, False).score == PageScore.BOUND


def _published(parser, *argv: str) -> SparseConfig:
    apply_cli_namespace(parser.parse_args(list(argv)))
    return settings_mod.EngineSettings.from_json(os.environ[settings_mod.ENV_VAR]).sparse


def test_the_server_publishes_the_models_score(sglang_parser, tmp_path, caplog):
    wide = _llama(tmp_path / "wide", 256)
    narrow = _llama(tmp_path / "narrow", 64)
    base = ("--kv-cache-dtype", "hack", "--device", "cpu", "--hack-sparse-budget", "4096")
    with caplog.at_level("INFO", logger="engine.sparse_choice"):
        assert _published(sglang_parser, "--model-path", wide, *base) == SparseConfig(
            budget_tokens=4096, score="linear", refine=WIDE_HEAD_REFINE)
    assert "--hack-sparse-score auto = linear: 256-channel heads" in caplog.text
    assert _published(sglang_parser, "--model-path", wide, *base, "--hack-sparse-score", "auto") == SparseConfig(
        budget_tokens=4096, score="linear", refine=WIDE_HEAD_REFINE)
    # the budget reaches the rule: 2K on wide heads is refined four times
    small = ("--kv-cache-dtype", "hack", "--device", "cpu", "--hack-sparse-budget", "2048")
    assert _published(sglang_parser, "--model-path", wide, *small) == SparseConfig(
        budget_tokens=2048, score="linear", refine=SMALL_BUDGET_REFINE)
    assert _published(sglang_parser, "--model-path", narrow, *small) == SparseConfig(budget_tokens=2048, score="bound")
    # by hand: the score, or the refinement, as given
    assert _published(sglang_parser, "--model-path", wide, *small, "--hack-sparse-score", "bound") == SparseConfig(
        budget_tokens=2048, score="bound")
    # (a refinement other than the one `auto` would take at that budget)
    assert _published(sglang_parser, "--model-path", wide, *base, "--hack-sparse-refine", "4") == SparseConfig(
        budget_tokens=4096, score="linear", refine=4)
    assert _published(sglang_parser, "--model-path", wide, *small, "--hack-sparse-refine", "2") == SparseConfig(
        budget_tokens=2048, score="linear", refine=2)
    # no local folder to read the width from: the bound, the exact score
    assert _published(sglang_parser, "--model-path", str(tmp_path / "absent"), *small).score == PageScore.BOUND


def test_auto_while_sparse_decode_is_off_chooses_nothing(sglang_parser, tmp_path):
    wide = _llama(tmp_path / "wide", 256)
    assert _published(sglang_parser, "--model-path", wide, "--kv-cache-dtype", "hack",
                      "--hack-sparse-score", "auto") == SparseConfig()
