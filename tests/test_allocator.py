"""The servers' allocator (engine/allocator.py): tcmalloc preloaded when installed, glibc's on
request, a caller's own choice kept, an unknown name refused; and a real process started with
the environment does run on tcmalloc."""
from __future__ import annotations

import subprocess
import sys

import pytest

from engine import allocator
from engine.cpu_runtime import shared_host_env


@pytest.fixture()
def fake_lib(tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    return tmp_path


def test_tcmalloc_preloaded_ahead_of_the_callers_preload(fake_lib):
    env = allocator.apply({"LD_PRELOAD": "/opt/libfoo.so"}, dirs=(str(fake_lib),))
    assert env["LD_PRELOAD"].split() == [str(fake_lib / "libtcmalloc_minimal.so.4"), "/opt/libfoo.so"]
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40


def test_system_allocator_and_a_callers_allocator_are_kept(fake_lib):
    env = allocator.apply({allocator.ALLOCATOR_ENV: "system"}, dirs=(str(fake_lib),))
    assert "LD_PRELOAD" not in env
    env = allocator.apply({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, dirs=(str(fake_lib),))
    assert env["LD_PRELOAD"] == "/usr/lib/libjemalloc.so.2"
    with pytest.raises(ValueError, match="HACK_SERVER_ALLOCATOR='mimalloc' is not an allocator"):
        allocator.apply({allocator.ALLOCATOR_ENV: "mimalloc"}, dirs=(str(fake_lib),))


def test_missing_tcmalloc_leaves_glibc_and_warns_once(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(allocator, "_warned", [])
    with caplog.at_level("WARNING"):
        a = allocator.apply({}, dirs=(str(tmp_path),))
        b = allocator.apply({}, dirs=(str(tmp_path),))
    assert "LD_PRELOAD" not in a and "LD_PRELOAD" not in b
    assert sum("tcmalloc is not installed" in r.message for r in caplog.records) == 1


@pytest.mark.skipif(allocator.find_tcmalloc() is None, reason="needs libtcmalloc-minimal4 (make install)")
def test_a_server_environment_runs_python_on_tcmalloc(monkeypatch):
    """What every server started here gets: the process maps tcmalloc."""
    monkeypatch.delenv(allocator.ALLOCATOR_ENV, raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    import os

    env = shared_host_env(dict(os.environ))
    out = subprocess.run([sys.executable, "-c", "print(open('/proc/self/maps').read())"],
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    assert "libtcmalloc" in out.stdout


def test_describe_names_what_servers_get(fake_lib, tmp_path):
    assert allocator.describe({}, dirs=(str(fake_lib),)) == "libtcmalloc_minimal.so.4"
    assert allocator.describe({allocator.ALLOCATOR_ENV: "system"}, dirs=(str(fake_lib),)) == \
        "glibc malloc (HACK_SERVER_ALLOCATOR=system)"
    assert allocator.describe({}, dirs=(str(tmp_path / "none"),)) == "glibc malloc (tcmalloc not installed)"


SHAPES_CHILD = """
import random, torch, torch.nn.functional as F
torch.set_num_threads(1)
def rss_mb():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
w = torch.randn(1024, 512, dtype=torch.DTYPE)
F.linear(torch.randn(8, 512, dtype=torch.DTYPE), w)
start = rss_mb()
random.seed(0)
for m in random.sample(range(16, 2000), 600):  # 600 distinct token counts, as prefill batches
    F.linear(torch.randn(m, 512, dtype=torch.DTYPE), w)
print(rss_mb() - start)
"""


def _growth_mb(env: dict[str, str], dtype: str = "bfloat16") -> float:
    out = subprocess.run([sys.executable, "-c", SHAPES_CHILD.replace("DTYPE", dtype)], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def test_server_environment_bounds_onednn_per_shape_caches():
    """A BF16 linear at 600 new shapes: with oneDNN's default caches resident memory grows with
    every shape; with a server's environment it stops once the bounded caches are full. On a CPU
    without BF16 arithmetic servers run float32 weights (engine.cpu_dtype), whose linears take
    MKL's sgemm and keep no per-shape primitives (AMD EPYC Zen 3: 26 MB default, 23 MB bounded;
    a BF16 probe there takes minutes): there the server's own dtype is probed and its growth
    must stay small."""
    import os

    from engine import cpu_dtype

    base = {k: v for k, v in os.environ.items()
            if k not in ("LD_PRELOAD", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    if not cpu_dtype.bf16_arithmetic():
        bounded = _growth_mb(shared_host_env({**base, allocator.ALLOCATOR_ENV: "system"}), dtype="float32")
        assert bounded < 100, f"a server's float32 linears grew {bounded:.0f} MB over 600 shapes"
        return
    unbounded = _growth_mb({**base, allocator.ALLOCATOR_ENV: "system"})
    bounded = _growth_mb(shared_host_env({**base, allocator.ALLOCATOR_ENV: "system"}))
    assert unbounded > 150, f"default caches grew only {unbounded:.0f} MB; the probe no longer probes"
    assert bounded < 0.5 * unbounded, (bounded, unbounded)
