"""How a CPU server starts its scheduler and detokenizer processes: by fork, not spawn.

SGLang starts them with multiprocessing's "spawn": each child is a fresh interpreter that imports
SGLang, torch and transformers again, work its launcher process has just done. On a 2-core AMD
EPYC (Zen 3) that import took about 20 CPU-seconds per process, and a SmolLM2 server came up in 56 s
by spawn against 32 s by fork with the same first tokens (docs/engine.md, "Server start"). A
forked child inherits the launcher's imported modules and starts at once.

Fork is only safe when the launcher holds nothing a child cannot inherit: CUDA (so GPU servers
keep spawn) and a started OpenMP thread team. GNU libgomp, torch's OpenMP runtime, keeps no state
across fork: a child whose parent ran a multi-threaded torch op blocks forever in its first one.
SGLang's launcher runs none before it starts its children, but nothing guarantees that (another
plugin, a later version), so the choice is checked, not assumed: a probe child is forked first
and must finish multi-threaded torch ops within seconds, or the server keeps spawn and says why.

HACK_PROCESS_START=spawn keeps SGLang's spawn on a CPU server (fork forces fork where the probe
passed only; auto is the default).
"""
from __future__ import annotations

import enum
import logging
import multiprocessing as mp
import os
import sys
from typing import Any

logger = logging.getLogger(__name__)

ENV = "HACK_PROCESS_START"
PROBE_TIMEOUT_S = 10.0


class StartMethod(str, enum.Enum):
    AUTO = "auto"
    FORK = "fork"
    SPAWN = "spawn"


def requested(environ: dict | None = None) -> StartMethod:
    """The start method HACK_PROCESS_START asks for (auto when unset)."""
    text = (os.environ if environ is None else environ).get(ENV, "").strip().lower() or "auto"
    try:
        return StartMethod(text)
    except ValueError:
        raise ValueError(f"{ENV}={text!r}: expected one of "
                         f"{', '.join(m.value for m in StartMethod)}") from None


def _probe_body() -> None:
    import torch

    torch.set_num_threads(max(2, torch.get_num_threads()))
    a = torch.ones(256, 256)
    (a @ a).sum()                                # BLAS threads
    torch.ones(1 << 20).mul_(2).sum()            # ATen's parallel_for (OpenMP)


def fork_probe(timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Fork a child that runs multi-threaded torch ops: None when it finished, else why fork is
    unsafe from this process (the child is killed)."""
    try:
        ctx = mp.get_context("fork")
    except ValueError:
        return "this platform has no fork"
    proc = ctx.Process(target=_probe_body, name="hack-fork-probe", daemon=True)
    proc.start()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        return (f"a forked child's multi-threaded torch op did not finish in {timeout_s:g} s (this process "
                "started an OpenMP thread team before its children: libgomp does not survive fork)")
    if proc.exitcode != 0:
        return f"a forked child's multi-threaded torch op failed (exit code {proc.exitcode})"
    return None


def choose(device: str | None, want: StartMethod, probe=fork_probe) -> tuple[StartMethod, str]:
    """The start method for a server's children on `device`, and the reason, for the log."""
    if want is StartMethod.SPAWN:
        return StartMethod.SPAWN, f"{ENV}=spawn"
    if device not in ("cpu", None):
        return StartMethod.SPAWN, f"a {device} server (CUDA does not survive fork)"
    why_not = probe()
    if why_not is not None:
        return StartMethod.SPAWN, why_not
    how = f"{ENV}=fork" if want is StartMethod.FORK else "CPU server"
    return StartMethod.FORK, f"{how}: the children inherit the launcher's imported modules"


def prometheus_follows_environment() -> bool:
    """Let metrics created from now on use the storage PROMETHEUS_MULTIPROC_DIR asks for.

    prometheus_client picks in-memory or multiprocess storage when it is first imported, and SGLang
    sets the directory (--enable-metrics) after the launcher imported it (through the PD
    connector's modules). A spawned child imports it afresh and writes its metrics into the
    directory, where the launcher's /metrics reads them; a forked child inherits the launcher's
    choice, so its `sglang:` metrics would stay in its own memory and never reach /metrics.
    True when the storage was switched."""
    values = sys.modules.get("prometheus_client.values")
    if values is None or not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return False
    values.ValueClass = values.get_value_class()
    return True


def apply(server_args: Any) -> StartMethod:
    """After SGLang chose spawn (sglang.srt.entrypoints.engine._set_envs_and_config): fork on a
    CPU server where the probe passes."""
    method, why = choose(getattr(server_args, "device", None), requested())
    if method is StartMethod.FORK:
        prometheus_follows_environment()
        mp.set_start_method("fork", force=True)
    logger.info("sglang-hack: scheduler and detokenizer start by %s (%s)", method.value, why)
    return method
