"""Start and stop the cluster's processes by pid (each in its own process group)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from engine import server_zygote


def spawn(cmd: list[str], env: dict, log_path: Path, netns: str | None = None) -> int:
    """Start `cmd` (inside `netns` if given) in its own process group; output to log_path. Returns pid.
    A server command is forked from the server zygote when one is set (engine/server_zygote.py,
    which joins `netns` itself); then the server is the zygote's child, not ours."""
    if os.environ.get(server_zygote.ENV) and server_zygote.is_server_command(cmd):
        pid, why_not = server_zygote.spawn_or_none(cmd, env, log_path, netns=netns)
        if pid is not None:
            return pid
        with open(log_path, "a") as log:
            log.write(f"sglang-hack: started without the server zygote: {why_not}\n")
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]  # exec's the command: same pid
    log = open(log_path, "ab")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, preexec_fn=os.setsid)
    log.close()
    return proc.pid


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return server_zygote.running(pid)  # a zombie child of ours (or of the zygote) counts as gone


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _leader_alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it when it is our child
    except ChildProcessError:
        pass
    return alive(pid)


def stop(pid: int, grace_s: float = 10.0) -> bool:
    """Stop the process group led by `pid` (stop_all). True if it was running."""
    return bool(stop_all([pid], grace_s))


def kill_hard(pid: int) -> None:
    """SIGKILL the process group at once (fault tests: a server that dies mid-transfer)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_all(pids: list[int], grace_s: float = 8.0) -> list[int]:
    """Stop the process groups of all `pids` at once: SIGTERM each leader, which stops its own
    children (an SGLang server's launcher drains and ends its scheduler and detokenizer), then
    SIGKILL what is left of each group once its leader is gone or after `grace_s`. Returns the
    pids that were running. One shared grace period (not one per process) keeps `hack down` and a
    stopped `hack up` within seconds however many servers there are. (SIGTERM to a whole server
    group made the children exit first; the launcher took that for a crash and spent 5 s on crash
    diagnostics before it exited.)"""
    running = [p for p in pids if alive(p) or _group_alive(p)]
    for p in running:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + grace_s
    while time.time() < deadline and any(_leader_alive(p) for p in running):
        time.sleep(0.2)
    for p in running:
        try:
            os.killpg(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + 5.0
    while time.time() < deadline and any(_group_alive(p) or _leader_alive(p) for p in running):
        time.sleep(0.2)
    return running
