"""The kernel tests and the GPU benchmark run on a machine with only torch, triton, numpy and
pytest (a GPU box without SGLang): a subprocess imports them with every other third-party
package made unimportable (and sglang first of all), and lists anything that slipped in."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = ["test_triton_store", "test_triton_decode", "test_triton_prefill", "test_triton_aot", "test_triton_imports",
           "hack_ops.triton.testing", "hack_ops.triton.aot", "hack_ops.triton.benchcases", "hack_cli.bench_attention_gpu",
           "hack_cli.bench_attention", "hack_cli.bench_attention_options", "hack_ops.kernel_device", "hack_ops.triton.sass_profile", "test_sass_profile",
           # the CUDA decode and store kernels' tests, build and benchmarks (scripts/gpu_check.sh runs them there)
           "test_cuda_decode", "test_cuda_static", "hack_ops.cuda.build", "hack_ops.cuda.profile", "hack_ops.cuda.simt",
           "hack_ops.cuda.emulate", "hack_cli.bench_decode_cuda", "hack_cli.bench_decode_model",
           "test_cuda_store", "hack_ops.cuda.store", "hack_cli.bench_prefill_cuda"]

# Run in a fresh interpreter: load the allowed packages (and what they pull in), then refuse
# every new top-level module that is neither stdlib nor this project's.
SCRIPT = textwrap.dedent('''
    import importlib, importlib.abc, sys
    import numpy, pytest, torch, triton, triton.language
    allowed = {n.split(".")[0] for n in sys.modules} | set(sys.stdlib_module_names) | {"hack_ops", "hack_cli",
               "conftest"} | {m for m in sys.argv[1:] if "." not in m}
    refused = []

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            top = name.split(".")[0]
            if top == "sglang" or top not in allowed:
                refused.append(top)
                raise ImportError(f"{top} is not allowed here")
            return None

    sys.meta_path.insert(0, Refuse())
    sys.path.insert(0, "tests")
    import conftest
    for m in sys.argv[1:]:
        importlib.import_module(m)
    print("REFUSED", sorted(set(refused)))
''')


def test_kernel_tests_and_gpu_bench_import_without_sglang():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", SCRIPT, *MODULES], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "REFUSED []" in res.stdout, res.stdout + res.stderr[-2000:]


def test_the_guard_refuses_sglang():
    """The check above can fail: importing sglang (or any other package) under it is refused."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = SCRIPT.replace("for m in sys.argv[1:]:", "for m in ['sglang', *sys.argv[1:]]:")
    res = subprocess.run([sys.executable, "-c", script, "hack_ops.triton.testing"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "sglang is not allowed here" in res.stderr
