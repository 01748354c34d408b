"""`--hack-4bit-layers full`: a named layer set resolved from the model's own config into indices,
in the launching process (the published settings hold plain indices), refused with a sentence
on a model where it names no layer or every layer. The pool's handling of the indices is
tests/test_layer_bits.py's."""
from __future__ import annotations

import argparse
import json
import os

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from engine import cpu_runtime  # noqa: E402

cpu_runtime.prepare()

from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config  # noqa: E402

from engine import settings as settings_mod  # noqa: E402
from engine.args import HackArgumentError, layer_list  # noqa: E402
from engine.layer_sets import LayerSet, full_attention_layers, resolve_layers  # noqa: E402
from engine.server_options import apply_cli_namespace  # noqa: E402
from hack_cli.server_methods import method_args  # noqa: E402


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(settings_mod.ENV_VAR, raising=False)


def test_the_flag_takes_indices_or_a_set_name():
    assert layer_list("1, 5,5") == (1, 5, 5)  # HackConfig sorts and dedups
    assert layer_list("full") is LayerSet.FULL_ATTENTION and layer_list(" FULL ") is LayerSet.FULL_ATTENTION
    assert layer_list("auto") is LayerSet.AUTO and layer_list("None") is LayerSet.NONE
    with pytest.raises(argparse.ArgumentTypeError, match="or 'full', 'auto', 'none', got 'fulll'"):
        layer_list("fulll")


def test_full_attention_layers_from_each_kind_of_config():
    # Gemma-3-270M's pattern: five window layers, then a full one.
    assert full_attention_layers(Gemma3TextConfig(num_hidden_layers=18)) == (5, 11, 17)
    assert full_attention_layers(Gemma3TextConfig(num_hidden_layers=8)) == (5,)
    # An explicit layer_types list wins over any pattern.
    cfg = LlamaConfig(num_hidden_layers=4)
    cfg.layer_types = ["full_attention", "sliding_attention", "chunked_attention", "full_attention"]
    assert full_attention_layers(cfg) == (0, 3)
    # No layer_types: one window for every layer (Mistral), or none at all (Llama).
    assert full_attention_layers(MistralConfig(num_hidden_layers=3, sliding_window=4096)) == ()
    assert full_attention_layers(LlamaConfig(num_hidden_layers=3)) == (0, 1, 2)


def test_a_set_that_names_no_layer_or_every_layer_is_refused():
    with pytest.raises(ValueError, match="every layer of model .* has one; name the layers as indices"):
        resolve_layers(LayerSet.FULL_ATTENTION, MistralConfig(num_hidden_layers=3, sliding_window=4096))
    with pytest.raises(ValueError, match="has no sliding-window layers, so it would name all of them; "
                                         "use --hack-kv-bits 4"):
        resolve_layers(LayerSet.FULL_ATTENTION, LlamaConfig(num_hidden_layers=3))
    with pytest.raises(ValueError, match="no sliding-window layers"):  # Qwen2 with its window switched off
        resolve_layers(LayerSet.FULL_ATTENTION, Qwen2Config(num_hidden_layers=2, use_sliding_window=False))
    assert resolve_layers((3, 1), LlamaConfig()) == (3, 1) and resolve_layers(None, LlamaConfig()) is None


def test_auto_raises_the_full_layers_only_where_they_are_few():
    """`auto`: Gemma-3's 3 full layers of 18 (a sixth); no layer for a model without windows, one
    windowed everywhere, or one whose full layers are many (alternating, half of them)."""
    assert resolve_layers(LayerSet.AUTO, Gemma3TextConfig(num_hidden_layers=18)) == (5, 11, 17)
    assert resolve_layers(LayerSet.AUTO, LlamaConfig(num_hidden_layers=3)) == ()
    assert resolve_layers(LayerSet.AUTO, MistralConfig(num_hidden_layers=3, sliding_window=4096)) == ()
    alternating = LlamaConfig(num_hidden_layers=8)
    alternating.layer_types = ["sliding_attention", "full_attention"] * 4
    assert resolve_layers(LayerSet.AUTO, alternating) == ()
    quarter = LlamaConfig(num_hidden_layers=8)
    quarter.layer_types = ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"]
    assert resolve_layers(LayerSet.AUTO, quarter) == (3, 7)  # 2 of 8: a quarter
    assert resolve_layers(LayerSet.NONE, Gemma3TextConfig(num_hidden_layers=18)) == ()


def _model(folder, config) -> str:
    folder.mkdir()
    config.architectures = [type(config).__name__.replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")]
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    return str(folder)


def test_the_server_resolves_full_before_publishing(sglang_parser, tmp_path):
    parser = sglang_parser
    model = _model(tmp_path / "gemma3-config", Gemma3TextConfig(num_hidden_layers=12, head_dim=64, hidden_size=128,
                                                                num_attention_heads=2, num_key_value_heads=1))
    ns = parser.parse_args(["--model-path", model, "--kv-cache-dtype", "hack", "--hack-4bit-layers", "full"])
    apply_cli_namespace(ns)
    published = settings_mod.EngineSettings.from_json(os.environ[settings_mod.ENV_VAR])
    assert published.config.four_bit_layers == (5, 11)
    assert published.config.for_layer(5, 12).kv_bits == 4 and published.config.for_layer(4, 12).kv_bits == 2


def test_a_hack_server_raises_layers_by_its_plan_not_by_a_rule(sglang_parser, tmp_path, caplog):
    """No --hack-4bit-layers: the layers come from --hack-bits auto (the model's calibrated plan,
    tests/test_bit_plan.py), so a Gemma-3 config without a plan keeps every layer at 2 bits and the
    log says there is no plan; `--hack-4bit-layers auto` asked for by name still raises its full
    layers (and logs why); 'none' keeps every layer at 2 bits; a Llama config raises nothing."""
    parser = sglang_parser
    gemma = _model(tmp_path / "gemma3-config", Gemma3TextConfig(num_hidden_layers=12, head_dim=64, hidden_size=128,
                                                                num_attention_heads=2, num_key_value_heads=1))
    llama = _model(tmp_path / "llama-config", LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=2,
                                                          num_key_value_heads=1, intermediate_size=64, vocab_size=128))

    def published(*argv: str) -> tuple[int, ...]:
        apply_cli_namespace(parser.parse_args(list(argv)))
        return settings_mod.EngineSettings.from_json(os.environ[settings_mod.ENV_VAR]).config.four_bit_layers

    with caplog.at_level("INFO"):
        assert published("--model-path", gemma, "--kv-cache-dtype", "hack") == ()
    assert "--hack-bits auto: no bit plan for model" in caplog.text
    with caplog.at_level("INFO", logger="engine.server_options"):
        assert published("--model-path", gemma, "--kv-cache-dtype", "hack", "--hack-4bit-layers", "auto") == (5, 11)
    assert "--hack-4bit-layers auto = layers 5,11 (the full-attention layers" in caplog.text
    assert published("--model-path", gemma, "--kv-cache-dtype", "hack", "--hack-4bit-layers", "none") == ()
    assert published("--model-path", gemma, "--kv-cache-dtype", "hack", "--hack-4bit-layers", "auto",
                     "--hack-4bit-tensors", "k") == (5, 11)
    assert published("--model-path", llama, "--kv-cache-dtype", "hack") == ()
    with pytest.raises(HackArgumentError, match="--hack-4bit-tensors"):  # nothing raised: refused as before
        published("--model-path", llama, "--kv-cache-dtype", "hack", "--hack-4bit-tensors", "k")
    ns = parser.parse_args(["--model-path", gemma])
    apply_cli_namespace(ns)
    assert ns.hack_four_bit_layers is None  # not a HACK server: no HACK option appears


def test_the_server_refuses_full_on_a_model_without_windows(sglang_parser, tmp_path):
    parser = sglang_parser
    model = _model(tmp_path / "llama-config", LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=2,
                                                          num_key_value_heads=1, intermediate_size=64, vocab_size=128))
    ns = parser.parse_args(["--model-path", model, "--kv-cache-dtype", "hack", "--hack-4bit-layers", "full"])
    with pytest.raises(HackArgumentError, match="model LlamaForCausalLM has no sliding-window layers"):
        apply_cli_namespace(ns)
    assert settings_mod.ENV_VAR not in os.environ  # nothing published on refusal
    ns = parser.parse_args(["--model-path", str(tmp_path / "absent"), "--kv-cache-dtype", "hack",
                            "--hack-4bit-layers", "full"])
    with pytest.raises(HackArgumentError, match="resolved from the model's config.json"):
        apply_cli_namespace(ns)


def test_bench_methods_pass_the_set_name_to_the_server():
    assert method_args("hack-4bit-layers", LayerSet.FULL_ATTENTION)[-2:] == ["--hack-4bit-layers", "full"]
    assert method_args("hack-4bit-layers", (1, 5))[-2:] == ["--hack-4bit-layers", "1,5"]
    with pytest.raises(ValueError, match="needs --4bit-layers"):
        method_args("hack-4bit-layers", None)
    with pytest.raises(ValueError, match="needs --4bit-layers"):
        method_args("hack-4bit-layers", LayerSet.NONE)
    with pytest.raises(ValueError, match="names no layer of this model"):  # 'auto' resolved on a model without windows
        method_args("hack-4bit-layers", ())


def test_every_layer_flag_shows_the_same_choices():
    """The server's --hack-4bit-layers and the commands' --4bit-layers take the same words."""
    from engine.args import LAYER_SPEC_METAVAR

    assert LAYER_SPEC_METAVAR == "L,L,...|" + "|".join(m.value for m in LayerSet)
    assert set(LAYER_SPEC_METAVAR.split("|")[1:]) == {"full", "auto", "none"}
