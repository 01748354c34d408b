"""Start and stop the cluster's processes by pid (each in its own process group)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def spawn(cmd: list[str], env: dict, log_path: Path, netns: str | None = None) -> int:
    """Start `cmd` (inside `netns` if given) in its own process group; output to log_path. Returns pid."""
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
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop(pid: int, grace_s: float = 10.0) -> bool:
    """SIGTERM the process group led by `pid`, SIGKILL after `grace_s`. True if it was running."""
    was = alive(pid) or _group_alive(pid)
    if not was:
        return False
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.time() + wait
        while time.time() < deadline and _group_alive(pid):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.2)
        if not _group_alive(pid):
            break
    return True


def kill_hard(pid: int) -> None:
    """SIGKILL the process group at once (fault tests: a server that dies mid-transfer)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_all(pids: list[int], grace_s: float = 8.0) -> list[int]:
    """SIGTERM the process groups of all `pids` at once, SIGKILL the survivors after `grace_s`.
    Returns the pids that were running. One shared grace period (not one per process) keeps
    `hack down` and a stopped `hack up` within seconds however many servers there are."""
    running = [p for p in pids if alive(p) or _group_alive(p)]
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for p in running:
            try:
                os.killpg(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while time.time() < deadline and any(_group_alive(p) for p in running):
            for p in running:
                try:
                    os.waitpid(p, os.WNOHANG)
                except ChildProcessError:
                    pass
            time.sleep(0.2)
        if not any(_group_alive(p) for p in running):
            break
    return running
