"""`python -m sglang.launch_server` with the plugin installed: bad flag combinations stop the
launcher before any model is loaded, with exit status 2 and one clear sentence; the sgl_kernel
stand-in is used only when no real sgl_kernel imports, and names the kernel it lacks."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from engine.launcher import SGLangServer

pytestmark = [pytest.mark.integration]

EXIT_TIMEOUT_S = 120  # importing SGLang alone takes 6-9 s; nothing here loads a model


def _refused_launch(model_path, args, log_path) -> str:
    """Start the launcher, expect it to exit with status 2 (a refusal), return its log."""
    server = SGLangServer(str(model_path), args, log_path=log_path)
    server.start()
    try:
        code = server.wait_exit(EXIT_TIMEOUT_S)
    finally:
        server.stop()
    out = server.log_path.read_text(errors="replace")
    assert code == 2, out[-2000:]
    return out


@pytest.mark.parametrize("args, message", [
    (["--kv-cache-dtype", "hack", "--page-size", "16"],
     "--page-size 16 conflicts with the HACK partition size 64"),
    (["--kv-cache-dtype", "hack", "--attention-backend", "torch_native"],
     "only the 'hack' attention backend reads"),
    (["--kv-cache-dtype", "hack", "--hack-partition-size", "40"],
     "partition_size must be a multiple of 16"),
    (["--attention-backend", "hack"], "needs --kv-cache-dtype hack"),
    (["--hack-orientation", "token_k"], "only apply with --kv-cache-dtype hack"),
    (["--kv-cache-dtype", "hack", "--hack-kv-bits", "3"], "argument --hack-kv-bits: invalid choice"),
])
def test_bad_flags_fail_at_startup(tmp_path, args, message):
    # The model path does not even exist: the refusal must come before anything loads it.
    out = _refused_launch(tmp_path / "no-model", args, tmp_path / "launch.log")
    assert message in out, out[-2000:]
    assert "Traceback" not in out


def test_unserved_model_feature_is_refused_at_startup(tmp_path):
    """A model whose attention HACK does not serve (here MLA, a tiny config: the refusal comes
    before any weight is read) stops the launcher with the sentence naming the feature and the
    flag that works, not the scheduler at the first request."""
    import json

    model = tmp_path / "tiny-mla"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "kv_lora_rank": 16, "q_lora_rank": None,
        "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32, "vocab_size": 128}))
    out = _refused_launch(model, ["--kv-cache-dtype", "hack"], tmp_path / "launch.log")
    assert ("--kv-cache-dtype hack does not serve multi-head latent attention (MLA) (model DeepseekV3ForCausalLM); "
            "serve it with a BF16 KV cache instead (drop --kv-cache-dtype hack)") in out, out[-2000:]
    assert "Traceback" not in out


def _tiny_llama(folder, hidden_size: int, num_hidden_layers: int):
    """A Llama config without weights (2 query heads, 1 KV head): refusals come before loading."""
    import json

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 64, "vocab_size": 128}))
    return folder


def test_four_bit_layers_beyond_the_model_are_refused_at_startup(tmp_path):
    """--hack-4bit-layers names layers by index: one the model lacks (a tiny 2-layer Llama
    config, no weights) stops the launcher with the sentence, before anything loads."""
    model = _tiny_llama(tmp_path / "tiny-llama-2", hidden_size=128, num_hidden_layers=2)
    out = _refused_launch(model, ["--kv-cache-dtype", "hack", "--hack-4bit-layers", "1,5,7"], tmp_path / "launch.log")
    assert "--hack-4bit-layers names layers 5,7, but model LlamaForCausalLM has 2 layers (0..1)" in out, out[-2000:]
    assert "Traceback" not in out


def test_full_layer_set_on_a_model_without_windows_is_refused_at_startup(tmp_path):
    """`--hack-4bit-layers full` on a model with no sliding-window layer (a tiny Llama config, no
    weights) would name every layer: the launcher stops with the sentence, before anything loads."""
    model = _tiny_llama(tmp_path / "tiny-llama-full", hidden_size=128, num_hidden_layers=2)
    out = _refused_launch(model, ["--kv-cache-dtype", "hack", "--hack-4bit-layers", "full"], tmp_path / "launch.log")
    assert ("model LlamaForCausalLM has no sliding-window layers, so it would name all of them; "
            "use --hack-kv-bits 4") in out, out[-2000:]
    assert "Traceback" not in out


def test_rotation_of_an_odd_head_dim_is_refused_at_startup(tmp_path):
    """--hack-rotation needs a power-of-two head_dim: a model with head_dim 96 (tiny Llama
    config, no weights) stops the launcher with the sentence, before anything loads."""
    model = _tiny_llama(tmp_path / "tiny-llama-96", hidden_size=192, num_hidden_layers=1)
    out = _refused_launch(model, ["--kv-cache-dtype", "hack", "--hack-partition-size", "32",
                                  "--hack-rotation", "hadamard_v"], tmp_path / "launch.log")
    assert ("--hack-rotation hadamard_v needs a head_dim that is a power of two (a Walsh-Hadamard rotation), "
            "got head_dim 96; use --hack-rotation none (model LlamaForCausalLM)") in out, out[-2000:]
    assert "Traceback" not in out


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=120)


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SGLANG_USE_CPU_ENGINE")}
    env.update(extra)
    return env


def test_standin_only_without_real_kernel_and_names_the_kernel():
    res = _run("""
        import os
        from engine import cpu_runtime
        cpu_runtime.prepare()
        assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
        import sgl_kernel
        assert sgl_kernel.IS_HACK_STANDIN
        from sgl_kernel import copy_all_layer_kv_cache_cpu  # what SGLang's CPU engine imports
        try:
            copy_all_layer_kv_cache_cpu(1, 2)
        except RuntimeError as exc:
            print("ERR", exc)
        # children inherit the stand-in through PYTHONPATH
        import subprocess, sys
        r = subprocess.run([sys.executable, "-c", "import sgl_kernel; print(sgl_kernel.IS_HACK_STANDIN)"],
                           capture_output=True, text=True)
        print("CHILD", r.stdout.strip())
    """, _clean_env())
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ERR sgl_kernel.copy_all_layer_kv_cache_cpu was called" in res.stdout
    assert "CHILD True" in res.stdout


def test_a_real_sgl_kernel_is_never_shadowed(tmp_path):
    real = tmp_path / "sgl_kernel"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    res = _run("""
        from engine import cpu_runtime
        cpu_runtime.prepare()
        import sgl_kernel
        print("REAL", getattr(sgl_kernel, "REAL", False), getattr(sgl_kernel, "IS_HACK_STANDIN", False))
    """, _clean_env(PYTHONPATH=str(tmp_path)))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "REAL True False" in res.stdout
