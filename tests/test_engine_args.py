"""The plugin's server options on SGLang's real argument parser: parsing, mapping onto HackConfig,
and the combinations refused before a model is loaded."""
from __future__ import annotations

import argparse
import json
import os

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from engine import cpu_runtime  # noqa: E402

cpu_runtime.prepare()

from engine import settings as settings_mod  # noqa: E402
from engine.args import HackArgumentError  # noqa: E402
from engine.server_options import apply_cli_namespace  # noqa: E402
from hack_ops import HackConfig  # noqa: E402


@pytest.fixture()
def parser(sglang_parser) -> argparse.ArgumentParser:
    return sglang_parser


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(settings_mod.ENV_VAR, raising=False)


def _parse(parser, *extra):
    return parser.parse_args(["--model-path", "m", *extra])


def test_hack_defaults_come_from_hackconfig(parser):
    ns = _parse(parser, "--kv-cache-dtype", "hack")
    apply_cli_namespace(ns)
    s = settings_mod.active()
    assert s is not None and s.config == HackConfig()
    assert (s.prefill, s.attention, s.kv_budget_mb) == ("auto", "hack", None)
    # page size = partition size, backend selected because none was named
    assert ns.page_size == HackConfig().partition_size
    assert ns.attention_backend == "hack"


def test_every_option_maps_onto_settings(parser):
    ns = _parse(parser, "--kv-cache-dtype", "hack", "--hack-partition-size", "32",
                "--hack-rounding", "stochastic", "--hack-disable-summation-elimination",
                "--hack-disable-requant-elimination", "--hack-prefill", "exact",
                "--hack-orientation", "token_k", "--hack-sink-tokens", "0", "--hack-kv-bits", "4",
                "--hack-tail-tensors", "per_channel", "--hack-disable-range-search",
                "--hack-attention", "dequant", "--hack-kv-budget-mb", "64")
    apply_cli_namespace(ns)
    s = settings_mod.active()
    assert s.config == HackConfig(partition_size=32, rounding="stochastic", summation_elimination=False,
                                  requant_elimination=False, orientation="token_k", sink_tokens=0,
                                  kv_bits=4, tail_tensors="per_channel", range_search=False)
    assert (s.prefill, s.attention, s.kv_budget_mb) == ("exact", "dequant", 64.0)
    assert ns.page_size == 32
    # what children receive round-trips exactly
    assert settings_mod.EngineSettings.from_json(os.environ[settings_mod.ENV_VAR]) == s


def test_sparse_options_map_onto_settings(parser):
    from hack_ops.sparse import SparseConfig

    ns = _parse(parser, "--kv-cache-dtype", "hack", "--hack-sparse-budget", "2048", "--hack-sparse-recent", "128",
                "--hack-sparse-dense-layers", "1", "--hack-sparse-share-layers", "2", "--hack-sparse-score", "linear",
                "--hack-sparse-groups", "8")
    apply_cli_namespace(ns)
    s = settings_mod.active()
    assert s.sparse == SparseConfig(budget_tokens=2048, recent_tokens=128, dense_layers=1, share_layers=2,
                                    score="linear", group_pages=8)
    assert settings_mod.EngineSettings.from_json(os.environ[settings_mod.ENV_VAR]) == s
    ns = _parse(parser, "--kv-cache-dtype", "hack", "--hack-sparse-budget", "1024", "--hack-sparse-refine", "3")
    apply_cli_namespace(ns)
    assert settings_mod.active().sparse == SparseConfig(budget_tokens=1024, refine=3)
    assert settings_mod.EngineSettings.from_json(os.environ[settings_mod.ENV_VAR]) == settings_mod.active()
    assert not settings_mod.EngineSettings().sparse.enabled  # off by default


def test_static_eviction_options_map_onto_settings(parser):
    from hack_ops.static_keep import StaticKeep

    ns = _parse(parser, "--kv-cache-dtype", "hack", "--hack-static-keep", "0.5", "--hack-static-observe", "0.05",
                "--hack-static-unit", "head")
    apply_cli_namespace(ns)
    s = settings_mod.active()
    assert s.static == StaticKeep(keep=0.5, observe=0.05, unit="head")
    assert settings_mod.EngineSettings.from_json(os.environ[settings_mod.ENV_VAR]) == s
    assert not settings_mod.EngineSettings().static.enabled  # off by default


def test_matching_page_size_and_backend_are_accepted(parser):
    ns = _parse(parser, "--kv-cache-dtype", "hack", "--page-size", "64", "--attention-backend", "hack")
    apply_cli_namespace(ns)
    assert ns.page_size == 64 and ns.attention_backend == "hack"


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-dtype", "hack", "--page-size", "16"], "--page-size 16 conflicts with the HACK partition size 64"),
    (["--kv-cache-dtype", "hack", "--attention-backend", "torch_native"], "only the 'hack' attention backend"),
    (["--kv-cache-dtype", "hack", "--decode-attention-backend", "triton"], "--decode-attention-backend triton"),
    (["--kv-cache-dtype", "hack", "--hack-partition-size", "40"], "partition_size must be a multiple of 16"),
    (["--kv-cache-dtype", "hack", "--hack-sink-tokens", "65"], "sink_tokens must be an integer in 0..partition_size"),
    (["--attention-backend", "hack"], "needs --kv-cache-dtype hack"),
    (["--hack-rounding", "stochastic"], "only apply with --kv-cache-dtype hack"),
    (["--kv-cache-dtype", "hack", "--speculative-algorithm", "EAGLE"], "speculative decoding"),
    (["--kv-cache-dtype", "hack", "--hack-k-outlier-channels", "2"],
     "--hack-k-outlier-channels 2: implemented in the reference attention only"),
    (["--kv-cache-dtype", "hack", "--hack-orientation", "token_k", "--hack-k-outlier-channels", "1"],
     "k_outlier_channels needs orientation 'channel_k'"),
    (["--hack-k-outlier-channels", "1"], "only apply with --kv-cache-dtype hack"),
    (["--kv-cache-dtype", "hack", "--hack-4bit-tensors", "k"],
     "--hack-4bit-tensors k says which tensors of the raised layers take their bits; name those layers"),
    (["--hack-k-bits", "4"], "only apply with --kv-cache-dtype hack"),
    (["--hack-sparse-budget", "1024"], "only apply with --kv-cache-dtype hack"),
    (["--kv-cache-dtype", "hack", "--hack-sparse-budget", "1024", "--hack-attention", "dequant"],
     "--hack-attention dequant (the strawman baseline) does not take it"),
    (["--kv-cache-dtype", "hack", "--hack-sparse-budget", "1024", "--hack-orientation", "token_k"],
     "--hack-orientation token_k quantizes K per token"),
    (["--kv-cache-dtype", "hack", "--hack-sparse-budget", "100"], "is under two pages of 64 tokens"),
    (["--kv-cache-dtype", "hack", "--hack-prefill", "int8", "--hack-orientation", "token_k"],
     "--hack-prefill int8 reads K per channel and V per token (the default layout); --hack-orientation token_k"),
    (["--kv-cache-dtype", "hack", "--hack-prefill", "int8", "--hack-tail-tensors", "per_channel"],
     "--hack-tail-tensors per_channel keeps V's as codes. Use --hack-prefill homomorphic"),
    (["--kv-cache-dtype", "hack", "--hack-sparse-share-layers", "2"], "sparse decode, which is off"),
    (["--hack-static-keep", "0.5"], "only apply with --kv-cache-dtype hack"),
    (["--kv-cache-dtype", "hack", "--hack-static-observe", "0.1"], "static eviction, which is off"),
    (["--kv-cache-dtype", "hack", "--hack-static-keep", "0.5", "--hack-attention", "dequant"],
     "--hack-attention dequant (the strawman baseline) does not take it"),
    (["--kv-cache-dtype", "hack", "--hack-static-keep", "0.5", "--hack-sparse-budget", "1024"],
     "--hack-static-keep and --hack-sparse-budget each give decode its own page list"),
    (["--kv-cache-dtype", "hack", "--hack-static-keep", "0.5", "--disaggregation-mode", "decode",
      "--disaggregation-decode-enable-radix-cache"], "would share them with later requests"),
    (["--kv-cache-dtype", "hack", "--hack-static-keep", "0.5", "--enable-mixed-chunk"],
     "--enable-mixed-chunk runs decode requests through extend too"),
])
def test_bad_combinations_are_refused(parser, argv, message):
    ns = _parse(parser, *argv)
    with pytest.raises(HackArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        apply_cli_namespace(ns)
    assert settings_mod.ENV_VAR not in os.environ  # nothing published on refusal


@pytest.mark.parametrize("argv", [
    ["--hack-partition-size", "-64"],
    ["--hack-partition-size", "abc"],
    ["--hack-rounding", "up"],
    ["--hack-kv-bits", "3"],
    ["--hack-edge-layer-bits", "3"],
    ["--hack-4bit-layers", "1,-5"],
    ["--hack-4bit-layers", "first"],
    ["--hack-k-outlier-channels", "-1"],
    ["--hack-k-bits", "3"],
    ["--hack-4bit-tensors", "q"],
    ["--hack-kv-budget-mb", "0"],
    ["--kv-cache-dtype", "int3"],
    ["--hack-sparse-budget", "-1"],
    ["--hack-sparse-share-layers", "0"],
    ["--hack-static-keep", "0"],
    ["--hack-static-keep", "1.5"],
    ["--hack-static-observe", "x"],
    ["--hack-static-unit", "token"],
    ["--hack-sparse-refine", "0"],
    ["--hack-sparse-score", "mean"],
])
def test_malformed_values_are_argparse_errors(parser, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(parser, *argv)
    assert exc.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_study_options_parse_into_the_config_the_study_measures(parser):
    """They map onto HackConfig like every option (the refusal above names what no serving path
    does); per-layer bits are served, each layer laid out with its own."""
    from engine.args import settings_from_options

    ns = _parse(parser, "--kv-cache-dtype", "hack", "--hack-k-outlier-channels", "2", "--hack-edge-layer-bits", "4")
    assert settings_from_options(ns, enabled=True).config == HackConfig(k_outlier_channels=2, edge_layer_bits=4)
    ns = _parse(parser, "--kv-cache-dtype", "hack", "--hack-4bit-layers", "5, 1")
    assert settings_from_options(ns, enabled=True).config == HackConfig(four_bit_layers=(1, 5))
    apply_cli_namespace(ns)
    assert settings_mod.active().config == HackConfig(four_bit_layers=(1, 5))
    ns = _parse(parser, "--kv-cache-dtype", "hack", "--hack-edge-layer-bits", "4")
    apply_cli_namespace(ns)
    assert settings_mod.active().config == HackConfig(edge_layer_bits=4)
    # K and V with their own bits: served, and what children receive round-trips (the enum as its value)
    ns = _parse(parser, "--kv-cache-dtype", "hack", "--hack-4bit-layers", "5", "--hack-4bit-tensors", "k",
                "--hack-kv-bits", "4", "--hack-k-bits", "2")
    apply_cli_namespace(ns)
    split = settings_mod.active()
    assert split.config == HackConfig(four_bit_layers=(5,), raised_tensors="k", kv_bits=4, k_bits=2)
    assert settings_mod.EngineSettings.from_json(split.to_json()) == split


def test_budget_alone_applies_to_any_kv_dtype(parser):
    ns = _parse(parser, "--hack-kv-budget-mb", "128")
    apply_cli_namespace(ns)
    assert settings_mod.active() is None  # the cache is not HACK
    assert settings_mod.budget_bytes() == 128 << 20
    assert ns.page_size is None and ns.attention_backend is None  # untouched


def test_disagg_mode_alias(parser):
    assert _parse(parser, "--disagg-mode", "prefill").disaggregation_mode == "prefill"
    assert _parse(parser, "--disaggregation-mode", "decode").disaggregation_mode == "decode"
    assert _parse(parser).disaggregation_mode == "null"  # the alias adds no default of its own


def test_settings_json_rejects_unknown_keys():
    bad = json.dumps({"enabled": True, "bogus": 1})
    with pytest.raises(ValueError, match="unknown keys"):
        settings_mod.EngineSettings.from_json(bad)
    with pytest.raises(ValueError, match="prefill must be one of"):
        settings_mod.EngineSettings(prefill="approx")


def test_hack_serve_builds_the_documented_command():
    from hack_cli.cmd_serve import command

    ns = argparse.Namespace(bf16=False, host="127.0.0.1", port=30001,
                            sglang_args=["--", "--hack-partition-size", "32"])
    cmd = command(ns, "/models/m")
    assert cmd[1:] == ["-m", "sglang.launch_server", "--model-path", "/models/m", "--device", "cpu",
                       "--host", "127.0.0.1", "--port", "30001", "--kv-cache-dtype", "hack",
                       "--hack-partition-size", "32"]
    ns.bf16, ns.sglang_args = True, []
    assert command(ns, "/m")[-2:] == ["--attention-backend", "torch_native"]
