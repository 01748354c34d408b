"""Start CPU servers by fork from one process that imported SGLang once (a zygote).

`python -m sglang.launch_server` spends its first 10 s (idle) to 17-20 s (busy) importing SGLang,
torch and transformers on a 2-core AMD EPYC Zen 3 before it reads an argument. Where many servers start on one host (the
test suite starts about fifty; `hack bench serve` several), a zygote pays that once: it imports
`sglang.launch_server` and waits on a Unix socket; each request forks a child that becomes the
server (own session and process group, log file as stdout/stderr, the request's working
directory, arguments and environment) and runs `sglang.launch_server` as `__main__`, as
`python -m` would. A SmolLM2 server was ready after 22 s instead of 31-32 (docs/engine.md,
"Server start").

A fork is only the same server as a fresh process when nothing the imports read differs, so a
request is served only if its environment equals the zygote's own starting environment except
for variables read after the imports (LAZY_KEYS, LAZY_PREFIXES); its command must be this
interpreter running `-m sglang.launch_server` (or the module the zygote preloaded); a request may
name a network namespace, which the child joins as `ip netns exec` would (enter_netns). Anything
else gets a refusal with the reason, and the caller starts the process itself (spawn_or_none
returns None). The zygote must have no other Python thread when it forks and must not have started an
OpenMP team (engine/process_start.py): it only imports, and it checks for Python threads before
each fork. The imports do start native threads: numpy's and scipy's OpenBLAS thread servers, idle,
which stop and restart themselves around a fork (pthread_atfork), as they do when a launcher
forks its scheduler (engine/process_start.py).

The zygote reaps its children and keeps their exit codes; callers that are not its parent ask
for a code with `poll` (ZygoteChild does). Set HACK_SERVER_ZYGOTE=SOCKET for the launchers of this
process and its children to use one (tests/conftest.py does); `start_zygote` starts one.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "HACK_SERVER_ZYGOTE"
SERVER_MODULE = "sglang.launch_server"
# Read by the plugin and SGLang at run time, never at import: they may differ per server.
LAZY_PREFIXES = ("HACK_", "SGLANG_DISAGGREGATION_")  # the latter: envs.*.get() in the PD connections
# PYTEST_CURRENT_TEST: pytest's name of the running test, different for each (nothing reads it);
# COLUMNS and LINES: a terminal's size, which tools set for their children and are read when printing.
LAZY_KEYS = frozenset({"SGLANG_HOST_IP", "PWD", "OLDPWD", "_", "SHLVL", "PYTEST_CURRENT_TEST", "COLUMNS", "LINES"})
READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 60.0


def _lazy(key: str) -> bool:
    return key in LAZY_KEYS or key.startswith(LAZY_PREFIXES)


def env_difference(base: dict[str, str], wanted: dict[str, str]) -> list[str]:
    """The variables that differ between `base` and `wanted` and may be read at import time:
    empty when a child forked from a process started with `base` equals a fresh `wanted` one."""
    keys = set(base) | set(wanted)
    return sorted(k for k in keys if not _lazy(k) and base.get(k) != wanted.get(k))


def child_env(current: dict[str, str], wanted: dict[str, str]) -> dict[str, str]:
    """The child's environment: the zygote's as its imports left it (they may add variables, as
    a fresh process's would), with the request's lazily read variables."""
    env = {k: v for k, v in current.items() if not _lazy(k)}
    env.update({k: v for k, v in wanted.items() if _lazy(k)})
    env.pop(ENV, None)
    return env


def module_of(cmd: list[str]) -> tuple[str, list[str]] | None:
    """(module, arguments) of `cmd` when it is this interpreter running `-m module ...`."""
    if len(cmd) >= 3 and os.path.realpath(cmd[0]) == os.path.realpath(sys.executable) and cmd[1] == "-m":
        return cmd[2], list(cmd[3:])
    return None


def is_server_command(cmd: list[str]) -> bool:
    """`cmd` is this interpreter running `-m sglang.launch_server`."""
    parsed = module_of(cmd)
    return parsed is not None and parsed[0] == SERVER_MODULE


# ---- the zygote -----------------------------------------------------------------------------------
class _Zygote:
    def __init__(self, sock_path: str, preload: str, start_env: dict[str, str]) -> None:
        self.sock_path = sock_path
        self.preload = preload
        self.start_env = start_env
        self.codes: dict[int, int] = {}
        self.children: set[int] = set()

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.codes[pid] = os.waitstatus_to_exitcode(status)

    def handle(self, request: dict, listener: socket.socket, conn: socket.socket) -> dict:
        op = request.get("op")
        if op == "poll":
            self.reap()
            pid = int(request["pid"])
            if pid in self.codes:
                return {"returncode": self.codes[pid]}
            return {"returncode": None, "known": pid in self.children}
        if op != "spawn":
            return {"error": f"unknown op {op!r}"}
        parsed = module_of(request["cmd"])
        if parsed is None or parsed[0] not in (self.preload, SERVER_MODULE):
            return {"refused": f"not `{sys.executable} -m {self.preload}`"}
        netns = request.get("netns")
        if netns and not (NETNS_RUN / netns).exists():
            return {"refused": f"no network namespace {netns!r} (no {NETNS_RUN / netns})"}
        differ = env_difference(self.start_env, request["env"])
        if differ:
            return {"refused": "the environment differs in " + ", ".join(differ[:8])}
        if threading.active_count() > 1:
            return {"refused": "the zygote runs a Python thread (fork could copy a held lock)"}
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child never returns into this loop
            code = 1
            try:
                listener.close()
                conn.close()
                code = _become(parsed[0], parsed[1], child_env(dict(os.environ), request["env"]),
                               request["cwd"], request["log"], netns)
            except BaseException:  # noqa: BLE001 - the child reports and exits whatever happened
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        self.children.add(pid)
        return {"pid": pid}

    def serve(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.sock_path)
        os.chmod(self.sock_path, 0o600)  # whoever may connect may start processes as this user
        listener.listen(16)
        print(json.dumps({"ready": os.getpid()}), flush=True)
        os.dup2(2, 1)  # a waiting caller stops reading stdout once ready: later output goes to the log
        while True:
            self.reap()
            readable, _, _ = select.select([listener], [], [], 0.5)
            if not readable:
                continue
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(REQUEST_TIMEOUT_S)
                try:
                    request = json.loads(_read_line(conn))
                    reply = self.handle(request, listener, conn)
                except Exception as exc:  # noqa: BLE001 - a bad request must not end the zygote
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                try:
                    conn.sendall((json.dumps(reply) + "\n").encode())
                except OSError:
                    pass


NETNS_RUN = Path("/run/netns")   # where `ip netns add` pins its namespaces
NETNS_ETC = Path("/etc/netns")   # files `ip netns exec` mounts over /etc in a namespace
_CLONE_NEWNS, _CLONE_NEWNET = 0x00020000, 0x40000000
_MS_RDONLY, _MS_BIND, _MS_REC, _MS_SLAVE, _MNT_DETACH = 1, 4096, 16384, 1 << 19, 2


def enter_netns(name: str) -> None:
    """Join network namespace `name` as `ip netns exec` does before it execs: the namespace, a
    private mount namespace whose mounts do not propagate back, /sys describing the namespace's
    devices, and /etc/netns/<name>/* over /etc (a shaped link's resolv.conf: disagg/netns.py).
    For a single-threaded process (a zygote's child right after fork). Raises OSError."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(ret: int, what: str) -> None:
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    fd = os.open(NETNS_RUN / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), f"setns {name}")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS), "unshare mount namespace")
    check(libc.mount(b"", b"/", b"none", _MS_SLAVE | _MS_REC, None), "make / a slave mount")
    flags = 0
    if libc.umount2(b"/sys", _MNT_DETACH) != 0 and os.statvfs("/sys").f_flag & os.ST_RDONLY:
        flags = _MS_RDONLY  # not unmountable here: overlaid, and a read-only one only read-only
    check(libc.mount(name.encode(), b"/sys", b"sysfs", flags, None), "mount the namespace's /sys")
    etc = NETNS_ETC / name
    if etc.is_dir():
        for entry in sorted(etc.iterdir()):
            target = Path("/etc") / entry.name
            if libc.mount(str(entry).encode(), str(target).encode(), b"none", _MS_BIND, None) != 0:
                print(f"sglang-hack: bind {entry} -> {target} failed: {os.strerror(ctypes.get_errno())}",
                      file=sys.stderr, flush=True)  # `ip netns exec` warns and goes on too


def _become(module: str, args: list[str], env: dict[str, str], cwd: str, log: str,
            netns: str | None = None) -> int:
    """In the forked child: the process `python -m module args` would be (inside `netns`, as
    `ip netns exec netns python -m ...` would). Returns its exit code."""
    import atexit
    import runpy

    os.setsid()
    # A fresh interpreter's handlers (it ignores SIGPIPE, as the zygote still does).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    print(f"sglang-hack: forked from the server zygote (pid {os.getppid()}), which imported "
          f"{module} once" + (f"; in network namespace {netns}" if netns else ""), file=sys.stderr, flush=True)
    if netns:
        enter_netns(netns)
    try:  # `ps` shows the server's command, not the zygote's (setproctitle: an SGLang dependency)
        import setproctitle

        setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *args]))
    except ImportError:
        pass
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[0] = cwd  # what `python -m` puts first
    sys.argv = [module, *args]
    # Run as __main__ from its source, as `python -m` does: the preloaded copy would only make
    # runpy warn that the module was imported before it ran (its imports stay loaded).
    sys.modules.pop(module, None)
    code: int = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: print, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    # What interpreter shutdown does before it exits: wait for non-daemon threads, run atexit.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data.decode()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m engine.server_zygote",
                                description="Fork servers from one process that imported SGLang once.")
    p.add_argument("socket", help="Unix socket path to listen on")
    p.add_argument("--preload", default=SERVER_MODULE, help="module imported once and run per request")
    a = p.parse_args(argv)
    start_env = dict(os.environ)
    start_env.pop(ENV, None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        import importlib

        importlib.import_module(a.preload)
    except BaseException as exc:  # noqa: BLE001 - say why and exit: callers start servers themselves
        print(json.dumps({"error": f"importing {a.preload} failed: {exc!r}"}), flush=True)
        return 1
    try:
        _Zygote(a.socket, a.preload, start_env).serve()
    finally:
        try:
            os.unlink(a.socket)
        except OSError:
            pass
    return 0


# ---- callers ---------------------------------------------------------------------------------------
def _request(sock_path: str, request: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(sock_path)
        s.sendall((json.dumps(request) + "\n").encode())
        return json.loads(_read_line(s))


def spawn_or_none(cmd: list[str], env: dict[str, str], log_path: Path | str, cwd: str | None = None,
                  netns: str | None = None, sock_path: str | None = None) -> tuple[int | None, str]:
    """Fork `cmd` from the zygote at `sock_path` (default: $HACK_SERVER_ZYGOTE). Returns (pid,
    "") or (None, why not): then the caller starts `cmd` itself."""
    sock_path = sock_path or os.environ.get(ENV, "")
    if not sock_path:
        return None, f"{ENV} is not set"
    if module_of(cmd) is None:
        return None, "not a `python -m` command of this interpreter"
    try:
        reply = _request(sock_path, {"op": "spawn", "cmd": list(cmd), "env": dict(env),
                                     "cwd": cwd or os.getcwd(), "log": str(log_path), "netns": netns})
    except (OSError, ValueError) as exc:
        return None, f"no zygote at {sock_path} ({exc})"
    if "pid" in reply:
        return int(reply["pid"]), ""
    return None, reply.get("refused") or reply.get("error") or "no pid"


def returncode(pid: int, sock_path: str) -> int | None:
    """The exit code of the zygote's child `pid`, None while it runs (or when the zygote is gone
    and the process too: then -1, its code is lost)."""
    try:
        reply = _request(sock_path, {"op": "poll", "pid": pid})
    except (OSError, ValueError):
        return None if running(pid) else -1
    if reply.get("returncode") is not None:
        return int(reply["returncode"])
    if not reply.get("known") and not running(pid):
        return -1
    return None


def running(pid: int) -> bool:
    """`pid` exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class ZygoteChild:
    """The part of subprocess.Popen's interface the launchers use, for a zygote's child."""

    pid: int
    sock_path: str
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not running(self.pid):
            self.returncode = returncode(self.pid, self.sock_path)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.1)
        return self.returncode  # type: ignore[return-value]


@dataclass
class Zygote:
    """A zygote process started by this one (start_zygote)."""

    proc: subprocess.Popen
    sock_path: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_zygote(sock_path: str, env: dict[str, str], log_path: Path | str, preload: str = SERVER_MODULE,
                 wait: bool = True, timeout: float = READY_TIMEOUT_S) -> Zygote:
    """Start a zygote with environment `env` (the one its servers must ask with). With `wait`,
    return once it listens (RuntimeError with its log when it does not come up); without, at
    once: until its socket exists, callers start their servers themselves."""
    env = {k: v for k, v in env.items() if k != ENV}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "engine.server_zygote", sock_path, "--preload", preload],
                                env=env, stdout=subprocess.PIPE if wait else log, stderr=log,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    if not wait:
        return Zygote(proc, sock_path)
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().decode() if ready else ""
    proc.stdout.close()
    if '"ready"' not in line:
        proc.kill()
        proc.wait(10)
        tail = Path(log_path).read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the server zygote did not start: {line.strip() or 'no answer'}\n{tail}")
    return Zygote(proc, sock_path)


if __name__ == "__main__":
    sys.exit(main())
