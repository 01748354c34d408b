"""engine/server_zygote.py: which requests a zygote serves, what its children see, and how the
launchers stop process groups (disagg/procs.py). A zygote here preloads a small probe module
(tests/zygote_probe.py) instead of SGLang: the same fork path, seconds instead of a minute. The
real servers of the suite start from the session's zygote (tests/conftest.py)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disagg import netns, procs
from engine import server_zygote as zyg
from engine.cpu_runtime import CPU_ENGINE_ENV, shared_host_env
from engine.launcher import SGLangServer

TESTS = str(Path(__file__).resolve().parent)


def test_only_variables_read_after_the_imports_may_differ():
    base = {"PATH": "/bin", "LD_PRELOAD": "/lib/a.so", "HACK_METRICS_RUN_DIR": "/a", "PWD": "/x"}
    assert zyg.env_difference(base, {**base, "HACK_METRICS_RUN_DIR": "/b", "SGLANG_HOST_IP": "10.0.0.1",
                                      "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60", "PWD": "/y"}) == []
    assert zyg.env_difference(base, {**base, "LD_PRELOAD": "/lib/b.so", "OMP_NUM_THREADS": "1"}) == \
        ["LD_PRELOAD", "OMP_NUM_THREADS"]
    assert zyg.env_difference(base, {k: v for k, v in base.items() if k != "PATH"}) == ["PATH"]
    # the child keeps what the zygote's imports set and takes the request's lazy variables
    child = zyg.child_env({**base, "SGLANG_USE_CPU_ENGINE": "1", zyg.ENV: "/s"},
                          {**base, "HACK_METRICS_RUN_DIR": "/b", "HACK_NEW": "1"})
    assert child == {"PATH": "/bin", "LD_PRELOAD": "/lib/a.so", "SGLANG_USE_CPU_ENGINE": "1",
                     "HACK_METRICS_RUN_DIR": "/b", "HACK_NEW": "1", "PWD": "/x"}


def test_commands_it_can_fork():
    assert zyg.is_server_command([sys.executable, "-m", "sglang.launch_server", "--port", "1"])
    assert not zyg.is_server_command(["/usr/bin/python2", "-m", "sglang.launch_server"])
    assert not zyg.is_server_command([sys.executable, "-m", "sglang_router.launch_router"])
    assert not zyg.is_server_command(["ip", "netns", "exec", "ns", sys.executable, "-m", "sglang.launch_server"])
    assert zyg.spawn_or_none(["sleep", "1"], {}, "/dev/null", sock_path="/nonexistent")[0] is None
    pid, why = zyg.spawn_or_none([sys.executable, "-m", "x"], {}, "/dev/null", sock_path="/nonexistent/z.sock")
    assert pid is None and "no zygote at /nonexistent/z.sock" in why


@pytest.fixture(scope="module")
def probe_zygote(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe-zygote")
    # the environment engine.launcher gives every server, with the probe importable
    env = shared_host_env({CPU_ENGINE_ENV: "1", **os.environ,
                           "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])})
    env.pop(zyg.ENV, None)
    env.pop("SGLANG_HACK_ENGINE", None)
    z = zyg.start_zygote(str(root / "z.sock"), env, root / "z.log", preload="zygote_probe", timeout=120)
    yield z, env, root
    z.stop()
    assert not (root / "z.sock").exists()  # it removes its socket when stopped


def _cmd(code: int) -> list[str]:
    return [sys.executable, "-m", "zygote_probe", str(code)]


def test_a_child_is_the_process_python_m_would_be(probe_zygote, tmp_path):
    z, env, _ = probe_zygote
    log = tmp_path / "child.log"
    pid, why = zyg.spawn_or_none(_cmd(3), {**env, "HACK_PROBE": "per-server"}, log, cwd=str(tmp_path),
                                 sock_path=z.sock_path)
    assert pid is not None, why
    child = zyg.ZygoteChild(pid, z.sock_path)
    assert child.wait(timeout=30) == 3  # its exit code, through the zygote that reaped it
    seen = json.loads(log.read_text().splitlines()[-1])
    assert seen["pid"] == pid and seen["sid"] == pid and seen["pgid"] == pid  # own session and group
    assert seen["cwd"] == str(tmp_path) and seen["argv"][1:] == ["3"] and seen["main"] == "__main__"
    assert seen["cmdline"] == f"{sys.executable} -m zygote_probe 3"  # what `ps` shows
    assert seen["probe"] == "per-server" and seen["zygote_env"] is None
    assert "found in sys.modules" not in log.read_text()  # run from source, as python -m does
    assert zyg.returncode(pid, z.sock_path) == 3


def test_a_request_that_would_import_differently_is_refused(probe_zygote, tmp_path):
    z, env, _ = probe_zygote
    pid, why = zyg.spawn_or_none(_cmd(0), {**env, "OMP_NUM_THREADS": "1"}, tmp_path / "a.log", sock_path=z.sock_path)
    assert pid is None and why == "the environment differs in OMP_NUM_THREADS"
    pid, why = zyg.spawn_or_none([sys.executable, "-m", "json.tool"], env, tmp_path / "c.log", sock_path=z.sock_path)
    assert pid is None and "not `" in why
    # a malformed request gets an error, and the zygote goes on serving
    assert "error" in zyg._request(z.sock_path, {"op": "spawn"})
    pid, why = zyg.spawn_or_none(_cmd(0), env, tmp_path / "d.log", sock_path=z.sock_path)
    assert pid is not None and zyg.ZygoteChild(pid, z.sock_path).wait(timeout=30) == 0


@pytest.mark.skipif(not netns.can_shape()[0], reason=netns.can_shape()[1])
def test_a_child_joins_a_network_namespace_as_ip_netns_exec_would(probe_zygote, tmp_path):
    """The prefill servers of a shaped link run in its namespace: the child joins it, sees its
    devices in /sys, and its /etc/netns files over /etc (the link's resolv.conf)."""
    z, env, _ = probe_zygote
    name = f"hackzt-{os.getpid()}"
    etc = netns.NETNS_ETC / name
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text("# zygote test\nnameserver 127.0.0.1\n")
        log = tmp_path / "ns.log"
        pid, why = zyg.spawn_or_none(_cmd(0), env, log, netns=name, sock_path=z.sock_path)
        assert pid is not None, why
        assert zyg.ZygoteChild(pid, z.sock_path).wait(timeout=30) == 0, log.read_text()
        seen = json.loads(log.read_text().splitlines()[-1])
        assert seen["netns_inode"] == os.stat(f"/run/netns/{name}").st_ino != os.stat("/proc/self/ns/net").st_ino
        assert seen["devices"] == ["lo"]  # a fresh namespace's only device
        assert seen["resolv"] == "# zygote test\nnameserver 127.0.0.1\n"
        assert Path("/etc/resolv.conf").read_text() != seen["resolv"]  # the host's is untouched
    finally:
        subprocess.run(["ip", "netns", "del", name], timeout=30)
        shutil.rmtree(etc, ignore_errors=True)
    pid, why = zyg.spawn_or_none(_cmd(0), env, tmp_path / "gone.log", netns=name, sock_path=z.sock_path)
    assert pid is None and f"no network namespace {name!r}" in why


def _group(pgid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


LEADER = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # same group
def stop(*_):
    if sys.argv[1] == "clean":  # stops its child itself, as an SGLang launcher does
        child.terminate(); child.wait()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop if sys.argv[1] != "stubborn" else signal.SIG_IGN)
print("up", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("kind", ["clean", "leaves-child", "stubborn"])
def test_stop_all_ends_the_leader_then_what_is_left_of_its_group(kind, tmp_path):
    log = tmp_path / "leader.log"
    pid = procs.spawn([sys.executable, "-c", LEADER, kind], dict(os.environ), log)
    deadline = time.time() + 30
    while "up" not in (log.read_text() if log.exists() else "") and time.time() < deadline:
        time.sleep(0.1)
    assert len(_group(pid)) == 2
    t0 = time.time()
    assert procs.stop_all([pid], grace_s=3.0) == [pid]
    took = time.time() - t0
    assert _group(pid) == [] and not procs.alive(pid)
    # a leader that exits on SIGTERM ends the stop at once; one that ignores it waits the grace
    assert took < 2.5 if kind != "stubborn" else 3.0 <= took < 10.0, took
    assert procs.stop_all([pid]) == []  # nothing left to stop


class _ProbeServer(SGLangServer):
    def command(self) -> list[str]:
        return [sys.executable, "-m", "zygote_probe", "sleep"]


def test_a_launcher_server_forks_from_the_zygote_and_stops(probe_zygote, monkeypatch, tmp_path):
    """SGLangServer.start asks the zygote of HACK_SERVER_ZYGOTE, with the environment it gives
    every server; stop() sends SIGTERM to the process, which has a fresh interpreter's default
    SIGTERM action (not the zygote's handler), and reads its code through the zygote."""
    z, env, _ = probe_zygote
    monkeypatch.setenv(zyg.ENV, z.sock_path)
    server = _ProbeServer("unused-model", log_path=tmp_path / "server.log", env={"PYTHONPATH": env["PYTHONPATH"]}).start()
    assert isinstance(server.proc, zyg.ZygoteChild)
    deadline = time.time() + 30
    while '"sid"' not in server.log_path.read_text() and time.time() < deadline:
        time.sleep(0.1)
    assert json.loads(server.log_path.read_text().splitlines()[-1])["sid"] == server.proc.pid
    assert server.proc.poll() is None
    server.stop(timeout=10)
    assert server.proc.returncode == -signal.SIGTERM and _group(server.proc.pid) == []


def test_a_refused_server_starts_as_usual_and_says_why(probe_zygote, monkeypatch, tmp_path):
    z, env, _ = probe_zygote
    monkeypatch.setenv(zyg.ENV, z.sock_path)
    server = _ProbeServer("unused-model", log_path=tmp_path / "server.log",
                          env={"PYTHONPATH": env["PYTHONPATH"], "OMP_NUM_THREADS": "1"}).start()
    try:
        assert isinstance(server.proc, subprocess.Popen)
        assert server.log_path.read_text().startswith(
            "sglang-hack: started without the server zygote: the environment differs in OMP_NUM_THREADS")
    finally:
        server.stop(timeout=10)
