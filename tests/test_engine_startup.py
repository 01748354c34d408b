"""`python -m sglang.launch_server` with the plugin installed: bad flag combinations stop the
launcher before any model is loaded, with exit status 2 and one clear sentence; the sgl_kernel
stand-in is used only when no real sgl_kernel imports, and names the kernel it lacks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.launcher import SGLangServer

pytestmark = [pytest.mark.integration]

EXIT_TIMEOUT_S = 120  # importing SGLang alone takes 6-9 s; nothing here loads a model


def _refused_launch(model_path, args, log_path) -> tuple[int, str]:
    """Start the launcher and wait for it to exit; its exit code and log (a refusal is 2)."""
    server = SGLangServer(str(model_path), args, log_path=log_path)
    server.start()
    try:
        code = server.wait_exit(EXIT_TIMEOUT_S)
    finally:
        server.stop()
    return code, server.log_path.read_text(errors="replace")


def _tiny_llama(folder, hidden_size: int, num_hidden_layers: int):
    """A Llama config without weights (2 query heads, 1 KV head): refusals come before loading."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 64, "vocab_size": 128}))
    return folder


def _tiny_mla(folder):
    """A DeepSeek-V3 config (multi-head latent attention) without weights."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "kv_lora_rank": 16, "q_lora_rank": None,
        "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32, "vocab_size": 128}))
    return folder


BAD_FLAGS = [
    (["--kv-cache-dtype", "hack", "--page-size", "16"],
     "--page-size 16 conflicts with the HACK partition size 64"),
    (["--kv-cache-dtype", "hack", "--attention-backend", "torch_native"],
     "only the 'hack' attention backend reads"),
    (["--kv-cache-dtype", "hack", "--hack-partition-size", "40"],
     "partition_size must be a multiple of 16"),
    (["--attention-backend", "hack"], "needs --kv-cache-dtype hack"),
    (["--hack-orientation", "token_k"], "only apply with --kv-cache-dtype hack"),
    (["--kv-cache-dtype", "hack", "--hack-kv-bits", "3"], "argument --hack-kv-bits: invalid choice"),
]
# Every refused launch of this module: case -> (the model folder, made under a root; the flags).
# The model path of a bad-flag case does not even exist: the refusal must come before anything
# loads it; the others are configs without weights.
REFUSED = {
    **{f"flags{i}": (lambda root: root / "no-model", args) for i, (args, _) in enumerate(BAD_FLAGS)},
    "mla": (lambda root: _tiny_mla(root / "tiny-mla"), ["--kv-cache-dtype", "hack"]),
    "4bit-beyond": (lambda root: _tiny_llama(root / "tiny-llama-2", hidden_size=128, num_hidden_layers=2),
                    ["--kv-cache-dtype", "hack", "--hack-4bit-layers", "1,5,7"]),
    "full-no-windows": (lambda root: _tiny_llama(root / "tiny-llama-full", hidden_size=128, num_hidden_layers=2),
                        ["--kv-cache-dtype", "hack", "--hack-4bit-layers", "full"]),
    "odd-head-dim": (lambda root: _tiny_llama(root / "tiny-llama-96", hidden_size=192, num_hidden_layers=1),
                     ["--kv-cache-dtype", "hack", "--hack-partition-size", "32", "--hack-rotation", "hadamard_v"]),
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Every case of REFUSED launched once, as many at a time as there are cores: each launch is a
    fresh launcher importing SGLang (several seconds of one core) that must exit 2, and one after
    the other they were most of this module's time. Case -> (exit code, log); each test asserts
    on its own case."""
    root = tmp_path_factory.mktemp("refused")
    launches = {name: (build(root), args) for name, (build, args) in REFUSED.items()}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {name: pool.submit(_refused_launch, model, args, root / f"{name}.log")
                   for name, (model, args) in launches.items()}
        return {name: f.result() for name, f in futures.items()}


def _refusal(refused: dict, case: str) -> str:
    code, out = refused[case]
    assert code == 2, out[-2000:]
    assert "Traceback" not in out, out[-2000:]
    return out


@pytest.mark.parametrize("case, message", [(f"flags{i}", msg) for i, (_, msg) in enumerate(BAD_FLAGS)],
                         ids=[f"args{i}-{msg}" for i, (_, msg) in enumerate(BAD_FLAGS)])
def test_bad_flags_fail_at_startup(refused, case, message):
    out = _refusal(refused, case)
    assert message in out, out[-2000:]


def test_unserved_model_feature_is_refused_at_startup(refused):
    """A model whose attention HACK does not serve (here MLA, a tiny config: the refusal comes
    before any weight is read) stops the launcher with the sentence naming the feature and the
    flag that works, not the scheduler at the first request."""
    out = _refusal(refused, "mla")
    assert ("--kv-cache-dtype hack does not serve multi-head latent attention (MLA) (model DeepseekV3ForCausalLM); "
            "serve it with a BF16 KV cache instead (drop --kv-cache-dtype hack)") in out, out[-2000:]


def test_four_bit_layers_beyond_the_model_are_refused_at_startup(refused):
    """--hack-4bit-layers names layers by index: one the model lacks (a tiny 2-layer Llama
    config, no weights) stops the launcher with the sentence, before anything loads."""
    out = _refusal(refused, "4bit-beyond")
    assert "--hack-4bit-layers names layers 5,7, but model LlamaForCausalLM has 2 layers (0..1)" in out, out[-2000:]


def test_full_layer_set_on_a_model_without_windows_is_refused_at_startup(refused):
    """`--hack-4bit-layers full` on a model with no sliding-window layer (a tiny Llama config, no
    weights) would name every layer: the launcher stops with the sentence, before anything loads."""
    out = _refusal(refused, "full-no-windows")
    assert ("model LlamaForCausalLM has no sliding-window layers, so it would name all of them; "
            "use --hack-kv-bits 4") in out, out[-2000:]


def test_rotation_of_an_odd_head_dim_is_refused_at_startup(refused):
    """--hack-rotation needs a power-of-two head_dim: a model with head_dim 96 (tiny Llama
    config, no weights) stops the launcher with the sentence, before anything loads."""
    out = _refusal(refused, "odd-head-dim")
    assert ("--hack-rotation hadamard_v needs a head_dim that is a power of two (a Walsh-Hadamard rotation), "
            "got head_dim 96; use --hack-rotation none (model LlamaForCausalLM)") in out, out[-2000:]


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
