"""`--model gemma3` reaches what each command runs: `hack up`, `hack bench serve|disagg|attention`,
`hack eval accuracy|retrieval|size`. No server starts: the real parser and command functions run, and the
first step that would load or serve the model is replaced by a recorder that stops the command.
Model preparation is replaced by a folder holding Gemma-3-270M's attention config, so the test
needs neither the GGUF package nor a conversion."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hack_cli.main import build_parser

# Gemma-3-270M's attention geometry as its converted config.json states it.
GEMMA3_CONFIG = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 18,
                 "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 640,
                 "sliding_window": 512,
                 "layer_types": ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)]}


class Reached(Exception):
    """Raised by a recorder: the command got as far as the model's first real use."""


@pytest.fixture()
def prepared(tmp_path, monkeypatch):
    """`prepare(name)` returns a per-name folder with a config.json and records the names asked."""
    import hack_eval.models as models

    asked: list[str] = []

    def fake_prepare(name: str = models.DEFAULT_MODEL, force: bool = False, log=print) -> Path:
        models._spec(name)  # an unknown name still fails as it would
        asked.append(name)
        folder = tmp_path / f"{name}-hf"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(GEMMA3_CONFIG))
        return folder

    import hack_eval.size as size

    def fake_dir(name: str = models.DEFAULT_MODEL) -> Path:
        return tmp_path / f"{name}-hf"

    for mod in (models, size):  # size imported the two names
        monkeypatch.setattr(mod, "prepare", fake_prepare)
        monkeypatch.setattr(mod, "model_dir", fake_dir)
    monkeypatch.setenv("HACK_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("HACK_CLUSTER_STATE_DIR", str(tmp_path / "state"))
    return {"asked": asked, "folder": tmp_path / "gemma3-hf"}


def _run(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    args.argv = argv
    with pytest.raises(Reached):
        args.func(args)


def test_hack_up_starts_the_gemma3_cluster(prepared, monkeypatch):
    from disagg import cluster

    seen = {}

    def fake_up(spec, log=print):
        seen["spec"] = spec
        raise Reached

    monkeypatch.setattr(cluster, "up", fake_up)
    _run(["up", "--model", "gemma3", "--kv", "hack"])
    spec = seen["spec"]
    assert prepared["asked"] == ["gemma3"]
    assert spec.model == "gemma3" and Path(spec.model_path) == prepared["folder"] and spec.kv == "hack"
    spec.validate()  # the folder exists: the spec would start


def test_hack_up_spec_is_what_the_command_starts(prepared):
    from hack_cli.cmd_cluster import spec_from_args

    args = build_parser().parse_args(["up", "--model", "gemma3", "--kv", "bf16", "--max-total-tokens", "4096"])
    spec = spec_from_args(args)
    assert (spec.model, spec.kv, spec.max_total_tokens) == ("gemma3", "bf16", 4096)
    assert Path(spec.model_path) == prepared["folder"]


def test_four_bit_layers_full_is_the_models_full_attention_layers(prepared, monkeypatch):
    """`--4bit-layers full` reaches each command as Gemma-3's full-attention layers, read from the
    prepared model's config: the cluster's server flags, the bench's servers and record, the study."""
    from hack_cli.cmd_cluster import spec_from_args

    spec = spec_from_args(build_parser().parse_args(["up", "--model", "gemma3", "--kv", "hack", "--4bit-layers", "full"]))
    assert spec.extra_server_args == ["--hack-4bit-layers", "5,11,17"]
    for word, flag in (("none", "none"), ("auto", "5,11,17")):  # every layer at 2 bits; the servers' default
        spec = spec_from_args(build_parser().parse_args(["up", "--model", "gemma3", "--kv", "hack", "--4bit-layers", word]))
        assert spec.extra_server_args == ["--hack-4bit-layers", flag]
    assert spec_from_args(build_parser().parse_args(["up", "--model", "gemma3", "--kv", "hack"])).extra_server_args == []

    import hack_cli.bench_serve as bench_serve

    seen = {}

    def fake_measure(methods, model_path, cfg, say, run_meta=None):
        seen["cfg"] = cfg
        raise Reached

    monkeypatch.setattr(bench_serve, "_measure_all", fake_measure)
    _run(["bench", "serve", "--model", "gemma3", "--methods", "bf16,hack-4bit-layers", "--4bit-layers", "full", "--no-doc"])
    assert seen["cfg"]["four_bit_layers"] == [5, 11, 17]

    import hack_eval.accuracy as accuracy

    def fake_study(**kwargs):
        seen["study"] = kwargs["four_bit_layers"]
        raise Reached

    monkeypatch.setattr(accuracy, "run_study", fake_study)
    _run(["eval", "accuracy", "--model", "gemma3", "--4bit-layers", "full", "--out", "", "--json-out", ""])
    assert seen["study"] == (5, 11, 17)


def test_four_bit_tensors_k_reaches_each_command(prepared, monkeypatch):
    """`--4bit-tensors k` (K alone at 4 bits in the raised layers) becomes the servers'
    --hack-4bit-tensors k, the study's rows; two values are refused where one server starts."""
    from hack_cli.cmd_cluster import spec_from_args
    from hack_cli.server_methods import method_args
    from hack_ops.config import RaisedTensors

    spec = spec_from_args(build_parser().parse_args(["up", "--model", "gemma3", "--kv", "hack", "--4bit-layers", "full",
                                                     "--4bit-tensors", "k"]))
    assert spec.extra_server_args == ["--hack-4bit-layers", "5,11,17", "--hack-4bit-tensors", "k"]
    assert method_args("hack-4bit-layers", (5,), "k")[-2:] == ["--hack-4bit-tensors", "k"]
    assert "--hack-4bit-tensors" not in method_args("hack-4bit-layers", (5,))

    import hack_cli.bench_serve as bench_serve

    seen = {}

    def fake_measure(methods, model_path, cfg, say, run_meta=None):
        seen["cfg"] = cfg
        raise Reached

    monkeypatch.setattr(bench_serve, "_measure_all", fake_measure)
    _run(["bench", "serve", "--model", "gemma3", "--methods", "bf16,hack-4bit-layers", "--4bit-layers", "full",
          "--4bit-tensors", "k", "--no-doc"])
    assert seen["cfg"]["four_bit_tensors"] == "k"

    import hack_eval.accuracy as accuracy

    def fake_study(**kwargs):
        seen["raised"] = kwargs["raised"]
        raise Reached

    monkeypatch.setattr(accuracy, "run_study", fake_study)
    _run(["eval", "accuracy", "--model", "gemma3", "--4bit-layers", "full", "--4bit-tensors", "kv,k",
          "--out", "", "--json-out", ""])
    assert seen["raised"] == (RaisedTensors.KV, RaisedTensors.K)
    for argv, why in ((["eval", "retrieval", "--model", "gemma3", "--served", "hack-4bit-layers", "--4bit-layers",
                        "full", "--4bit-tensors", "kv,k"], "give one --4bit-tensors value"),
                      (["eval", "accuracy", "--model", "gemma3", "--4bit-layers", "full", "--4bit-tensors", "q"],
                       "raised_tensors must be one of"),
                      (["eval", "accuracy", "--model", "gemma3", "--4bit-tensors", "k"], "give --4bit-layers too"),
                      (["up", "--model", "gemma3", "--4bit-tensors", "k"], "give --4bit-layers too"),
                      (["bench", "serve", "--model", "gemma3", "--4bit-tensors", "k", "--no-doc"],
                       "add it to --methods")):
        args = build_parser().parse_args(argv)
        with pytest.raises(ValueError, match=why):
            args.func(args)


def test_hack_up_refuses_an_unknown_model_name(prepared):
    args = build_parser().parse_args(["up", "--model", "gemma9"])
    with pytest.raises(ValueError, match="unknown model 'gemma9'; known: smollm2, gemma3"):
        args.func(args)


def test_bench_serve_serves_gemma3(prepared, monkeypatch):
    import hack_cli.bench_serve as bench_serve

    seen = {}

    def fake_measure(methods, model_path, cfg, say, run_meta=None):
        seen.update(methods=methods, model_path=model_path, run_meta=run_meta)
        raise Reached

    monkeypatch.setattr(bench_serve, "_measure_all", fake_measure)
    _run(["bench", "serve", "--model", "gemma3", "--methods", "bf16,hack", "--no-doc"])
    assert prepared["asked"] == ["gemma3"]
    assert Path(seen["model_path"]) == prepared["folder"] and seen["methods"] == ["bf16", "hack"]
    assert seen["run_meta"]["model"] == "gemma3"


def test_bench_disagg_serves_gemma3(prepared, monkeypatch):
    import disagg.bench

    seen = {}

    def fake_run(model_path, methods, rates, workload, n, rps, **kw):
        seen.update(model_path=model_path, methods=methods)
        raise Reached

    monkeypatch.setattr(disagg.bench, "run", fake_run)
    _run(["bench", "disagg", "--model", "gemma3", "--methods", "bf16,hack", "--rates", "100", "--no-doc"])
    assert prepared["asked"] == ["gemma3"]
    assert Path(seen["model_path"]) == prepared["folder"] and seen["methods"] == ["bf16", "hack"]


def test_bench_attention_measures_gemma3s_shape(prepared, monkeypatch):
    import hack_cli.bench_attention as bench_attention
    import hack_ops.paged.benchcases as benchcases

    seen = []

    def fake_decode_case(hq, h, d, batch, context):
        seen.append((hq, h, d))
        raise Reached

    monkeypatch.setattr(bench_attention, "roofline", lambda clock=None, repeats=3: {})
    monkeypatch.setattr(benchcases, "decode_case", fake_decode_case)
    _run(["bench", "attention", "--model", "gemma3", "--batches", "1", "--contexts", "1024"])
    assert seen == [(4, 1, 256)]  # --model alone: that model's row, first


def test_bench_attention_model_is_cpu_only(prepared):
    args = build_parser().parse_args(["bench", "attention", "--model", "gemma3", "--device", "cuda"])
    with pytest.raises(ValueError, match="--model is CPU only"):
        args.func(args)


def test_eval_accuracy_studies_gemma3(prepared, monkeypatch):
    import hack_eval.accuracy

    seen = {}

    def fake_study(**kw):
        seen.update(kw)
        raise Reached

    monkeypatch.setattr(hack_eval.accuracy, "run_study", fake_study)
    _run(["eval", "accuracy", "--model", "gemma3", "--core"])
    assert seen["model_name"] == "gemma3" and seen["core"] is True


def test_eval_retrieval_loads_gemma3(prepared, monkeypatch):
    import hack_eval.runner

    seen = {}

    def fake_load(path, threads=None):
        seen["path"] = path
        raise Reached

    monkeypatch.setattr(hack_eval.runner, "load_model", fake_load)
    _run(["eval", "retrieval", "--model", "gemma3", "--contexts", "512", "--items", "1"])
    assert seen["path"] == prepared["folder"] and prepared["asked"] == ["gemma3"]


def test_eval_size_reads_gemma3s_geometry(prepared, capsys):
    args = build_parser().parse_args(["eval", "size", "--model", "gemma3", "--json"])
    assert args.func(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0] == {"format": "bf16", "bytes_per_token_layer": 2 * 2 * 1 * 256, "ratio": 1.0}


def test_bench_serve_context_length_past_the_models_own(prepared, monkeypatch):
    """`hack bench serve --context-length N` lets a context past the model's config in (every
    server gets SGLang's max_position_embeddings override, the record says so); within the
    model's own positions nothing is overridden; a context past either is refused before any
    server starts, naming the flag."""
    import hack_cli.bench_serve as bench_serve

    seen = {}

    def fake_measure(methods, model_path, cfg, say, run_meta=None):
        seen["cfg"] = cfg
        raise Reached

    monkeypatch.setattr(bench_serve, "_measure_all", fake_measure)
    base = ["bench", "serve", "--model", "gemma3", "--methods", "bf16,hack", "--no-doc"]
    _run([*base, "--contexts", "16000", "--context-length", "16384"])  # the config says 8192 (no entry)
    assert seen["cfg"]["server_args"] == ["--json-model-override-args", '{"max_position_embeddings": 16384}']
    assert seen["cfg"]["context_length"] == 16384
    _run([*base, "--contexts", "4000", "--context-length", "4096"])
    assert seen["cfg"]["server_args"] == [] and seen["cfg"]["context_length"] == 4096
    for extra in (["--contexts", "16000"], ["--contexts", "16300", "--context-length", "16384"]):
        args = build_parser().parse_args([*base, *extra])
        args.argv = [*base, *extra]
        with pytest.raises(ValueError, match="--context-length"):
            args.func(args)
    text = bench_serve.render({"command": "c", "date": "d", "machine": "m", "methods": {}, "ratios_vs_bf16": {},
                               "config": {"contexts": [], "budget_mb": 512, "requests": 1, "concurrency": 1,
                                          "context_length": 16384, "server_args": ["x"]}})
    assert "every server at 16,384 positions (past the model's own context: speed, not answers)" in text
