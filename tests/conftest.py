"""Shared pytest setup."""
from __future__ import annotations

import functools
import os
import sys

# Before torch is imported: libgomp's default spin-waiting makes every multi-threaded torch op of
# this process wait for a scheduler slice at its barriers whenever the cores are busy (the servers
# these tests start, or other work on a shared host): a 2-thread page quantization took 1.65 s
# instead of 45 ms under load. Servers started by the tests inherit it, as `hack up`'s servers do
# (engine.cpu_runtime.shared_host_env).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from typing import TYPE_CHECKING  # noqa: E402

import pytest  # noqa: E402

if TYPE_CHECKING:  # imported by the fixture: engine.launcher needs `requests`, which a kernel-only
    from shared_servers import SharedServers  # run (scripts/gpu_check.sh on a bare GPU box) may lack

# Where the Triton kernels (hack_ops.triton) run in this test process: a CUDA GPU when torch
# sees one, else Triton's CPU interpreter on CPU tensors (HACK_KERNEL_DEVICE overrides, see
# hack_ops/kernel_device.py). Decided once, in pytest_configure, before triton is imported.
KERNEL_DEVICE = None


def pytest_configure(config) -> None:
    global KERNEL_DEVICE
    config.addinivalue_line("markers", "shared_servers(*names): the module's tests use these servers of "
                                       "tests/shared_servers.py (stopped after the last test that names them)")
    config.addinivalue_line("markers", "solo: a test that measures speed: under pytest-xdist it runs while the other "
                                       "workers wait between their tests (tests/conftest.py, pytest_runtest_protocol)")
    config.addinivalue_line("markers", "memory_heavy: a module that holds three or more SGLang servers (or a container "
                                       "stack) at once: under pytest-xdist no two such modules run together (tests/conftest.py)")
    config.addinivalue_line("markers", "cuda: kernel cases (real shapes, driver checks) that run only when the Triton kernels "
                                       "run on a CUDA GPU (skipped under the interpreter)")
    config.addinivalue_line("markers", "device: runs on the kernel device, a GPU when present, else Triton's interpreter; "
                                       "scripts/gpu_check.sh runs these beside the cuda-marked tests")
    import torch

    from hack_ops.kernel_device import ENV, KernelDevice, choose_kernel_device

    try:
        KERNEL_DEVICE = choose_kernel_device(os.environ.get(ENV), torch.cuda.is_available(),
                                             os.environ.get("TRITON_INTERPRET"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    if KERNEL_DEVICE is KernelDevice.CUDA:
        return  # compiled kernels: nothing to switch
    # Triton fixes the mode when it decorates functions, its own library included, so the
    # interpreter is switched on before triton is first imported; only for this process (the
    # environment variable is removed again, so servers started by tests do not inherit it).
    if "triton" in sys.modules or os.environ.get("TRITON_INTERPRET"):
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
    except ImportError:
        return
    finally:
        del os.environ["TRITON_INTERPRET"]
    triton.knobs.runtime.__dict__["interpret"] = True  # in-process override, no setenv


def pytest_collection_modifyitems(config, items) -> None:
    from hack_ops.kernel_device import KernelDevice

    for item in items:  # the shared servers and those modules' own servers together
        if _unit(item.nodeid) == SHARED_SERVERS_UNIT:
            item.add_marker(pytest.mark.memory_heavy)
    if KERNEL_DEVICE is KernelDevice.CUDA:
        return
    skip = pytest.mark.skip(reason="runs only when the Triton kernels run on a CUDA GPU (HACK_KERNEL_DEVICE, tests/conftest.py)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


# `make test` runs two pytest-xdist workers (--dist loadscope), with the scheduler below: a unit
# of work runs whole on one worker, in order. Each module is a unit (its module-scoped servers and
# clusters start once, and its tests keep their order), except that the modules with tests on the
# shared servers are one unit together: one worker starts each shared server once and stops it
# after its last user. (pytest-xdist's own loadgroup cannot do this under pytest 9: it renames
# items through an attribute pytest 9 no longer reads.)
SHARED_SERVERS_UNIT = "shared-servers"
_TESTS = os.path.dirname(os.path.abspath(__file__))


@functools.cache
def _uses_shared_servers(module: str) -> bool:
    """Whether the module marks tests with shared_servers, read from its source: xdist's
    controller, where the scheduler runs, never collects items (shared_servers.get refuses a
    module without the mark, so the text and the marks agree)."""
    try:
        with open(os.path.join(_TESTS, os.path.basename(module))) as f:
            return "pytest.mark.shared_servers(" in f.read()
    except OSError:
        return False


def _unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return SHARED_SERVERS_UNIT if _uses_shared_servers(module) else module


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a bare GPU box may lack
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ModuleScheduling(config, log)


def _run_lock(run: str, name: str):
    import tempfile

    return open(os.path.join(tempfile.gettempdir(), f"sglang-hack-tests-{run}-{name}.lock"), "a")


# Under pytest-xdist (two workers share this machine's cores and 24 GiB) two locks, files of the
# run, keep apart what must not overlap:
# - memory: a unit whose tests are marked `memory_heavy` (three or more SGLang servers at once,
#   about 2.3 GB each, or a container stack) holds it exclusively from its first test's setup to
#   its last test's teardown, so two such units never overlap (two did, and the kernel's OOM
#   killer took a scheduler). It is taken before the other lock: a worker waiting for it holds
#   nothing.
# - solo: every test, from the setup of the fixtures it is the first to need to its teardown,
#   holds it shared; a test marked `solo` holds it exclusively, so it starts once the other
#   worker's current test is done and the other worker starts its next test once it is done. Only
#   the tests that compare measured speeds need it (tests/test_engine_speed.py).
_MEMORY_LOCK = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _MEMORY_LOCK
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        yield
        return
    import fcntl

    if item.get_closest_marker("memory_heavy") and _MEMORY_LOCK is None:
        _MEMORY_LOCK = _run_lock(run, "memory")
        fcntl.flock(_MEMORY_LOCK, fcntl.LOCK_EX)
    try:
        with _run_lock(run, "solo") as f:
            fcntl.flock(f, fcntl.LOCK_EX if item.get_closest_marker("solo") else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    finally:
        if _MEMORY_LOCK is not None and (nextitem is None or _unit(nextitem.nodeid) != _unit(item.nodeid)):
            _MEMORY_LOCK.close()  # closing the file releases the lock
            _MEMORY_LOCK = None


# The shared servers (tests/shared_servers.py): who uses each last, so that it stops right after.
_SHARED: "SharedServers | None" = None
_LAST_USER: dict[str, str] = {}


def pytest_collection_finish(session) -> None:
    _LAST_USER.clear()
    for item in session.items:
        for mark in item.iter_markers("shared_servers"):
            for name in mark.args:
                _LAST_USER[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem) -> None:
    if _SHARED is not None:
        for name in list(_SHARED.running):
            if _LAST_USER.get(name) == item.nodeid:
                _SHARED.stop(name)


@pytest.fixture(scope="session")
def shared_servers(tmp_path_factory):
    """The servers of tests/shared_servers.py: `shared_servers.get(name)` in a module marked
    `pytest.mark.shared_servers(name, ...)`."""
    from shared_servers import SharedServers

    global _SHARED
    _SHARED = SharedServers(tmp_path_factory.mktemp("shared-servers"), last_user=_LAST_USER)
    try:
        yield _SHARED
    finally:
        _SHARED.stop_all()
        _SHARED = None


# The environment as the session began (after collection: test modules set SGLANG_USE_CPU_ENGINE
# when imported). Each test gets it back afterwards, whatever the test or the code it ran set
# (engine.cpu_runtime.prepare() sets SGLANG_USE_CPU_ENGINE and PYTHONPATH, torch's inductor its
# cache directory): every server a test starts sees the same environment wherever the test runs
# in the suite, and the server zygote below, started with it, can serve them all.
_SESSION_ENV: dict[str, str] = {}
_PYTEST_OWNED = "PYTEST_CURRENT_TEST"


@pytest.fixture(autouse=True)
def _environment_as_the_session_began(server_zygote):
    yield
    for key in set(os.environ) - set(_SESSION_ENV) - {_PYTEST_OWNED}:
        del os.environ[key]
    for key, value in _SESSION_ENV.items():
        if key != _PYTEST_OWNED and os.environ.get(key) != value:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def server_zygote(request, tmp_path_factory):
    """Servers started by the tests fork from one process that imported SGLang once
    (engine/server_zygote.py: 10-20 s less per start on a 2-core host, and the suite starts about
    fifty). Started in the background when the run has slow or integration tests, unless
    HACK_SERVER_ZYGOTE is set (a socket: use that one; "off": none). Until it listens, and for a
    server whose environment differs from this session's, servers start as usual."""
    from engine import server_zygote as zyg
    from hack_ops.kernel_device import KernelDevice

    wanted = os.environ.get(zyg.ENV)
    slow = any(item.get_closest_marker("slow") or item.get_closest_marker("integration")
               for item in request.session.items)
    zygote = None
    if wanted == "off":
        del os.environ[zyg.ENV]
    elif not wanted and slow and KERNEL_DEVICE is not KernelDevice.CUDA:
        from engine.cpu_runtime import CPU_ENGINE_ENV, shared_host_env

        root = tmp_path_factory.mktemp("zygote")
        # what engine.launcher and disagg.cluster start servers with
        env = shared_host_env({CPU_ENGINE_ENV: "1", **os.environ})
        env.pop("SGLANG_HACK_ENGINE", None)
        zygote = zyg.start_zygote(str(root / "zygote.sock"), env, root / "zygote.log", wait=False)
        os.environ[zyg.ENV] = zygote.sock_path
    _SESSION_ENV.clear()
    _SESSION_ENV.update(os.environ)
    try:
        yield zygote
    finally:
        if zygote is not None:
            os.environ.pop(zyg.ENV, None)
            zygote.stop()


def pytest_runtest_logreport(report) -> None:
    """With HACK_FAILURE_LOG=FILE, each failure's traceback is appended to FILE as it happens
    (scripts/gpu_check.sh): a run stopped at a time limit still says which tests failed and why,
    where pytest's own summary only comes at the end."""
    path = os.environ.get("HACK_FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # under xdist the controller receives every worker's report: it writes once
    with open(path, "a") as f:
        f.write(f"=== {report.nodeid} ({report.when}) ===\n{report.longreprtext}\n\n")


@pytest.fixture(scope="session")
def kernel_device():
    """The torch device of the Triton kernels' tensors: cuda, or cpu under the interpreter."""
    return KERNEL_DEVICE.torch_device


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small tensors: on a shared 2-core machine, intra-op threads only add synchronization."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture()
def sglang_parser():
    """SGLang's real server parser with the plugin's options added (engine.args.add_arguments)."""
    import argparse

    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from engine import cpu_runtime

    cpu_runtime.prepare()
    from sglang.srt.server_args import ServerArgs

    from engine.args import add_arguments

    p = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(p)
    add_arguments(p)
    return p
