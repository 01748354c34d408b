"""Start and stop real SGLang servers (with this plugin) as child processes, with bounded waits.

Used by the integration tests and `hack bench serve`. A server runs in its own process group so
that stopping it (by the pid we started) also ends its scheduler and detokenizer children.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from . import server_zygote
from .cpu_runtime import CPU_ENGINE_ENV, shared_host_env
from .generate_stream import stream_chunks

# Two servers starting together on a 2-core AVX2 host (AMD EPYC Zen 3) took over 240 s to come up:
# six processes importing SGLang at once.
STARTUP_TIMEOUT_S = 480.0


# A server binds its port ~30 s after we pick it. A port from the kernel's ephemeral range can be
# handed to anyone's bind(0) or outgoing connection meanwhile (a CI run lost a decode server to
# "address already in use" that way), so ports come from below that range, above the one SGLang
# uses for its own late-bound ports (22000-29999, sglang.srt.utils.network).
PORT_RANGE_LOW = 30000
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", attempts: int = 64) -> int:
    """A TCP port free on `host` now, for a process that binds it later: outside the ephemeral
    range when there is room, never one this process handed out before."""
    candidates = [p for p in range(PORT_RANGE_LOW, _ephemeral_low()) if p not in _handed_out]
    for port in random.sample(candidates, min(attempts, len(candidates))):
        if _bindable(host, port):
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room: the OS picks
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    _handed_out.add(port)
    return port


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message holds its log tail."""


@dataclass
class SGLangServer:
    """One `python -m sglang.launch_server` process on 127.0.0.1."""

    model_path: str
    args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model_path),
                "--device", "cpu", "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    def start(self) -> "SGLangServer":
        if self.proc is not None:
            raise RuntimeError("server already started")
        self.port = self.port or free_port()
        if self.log_path is None:
            self.log_path = Path(f"/tmp/sglang-hack-server-{self.port}.log")
        # Servers started here share the host with each other (tests, `hack bench serve`).
        env = shared_host_env({**os.environ, **self.env})
        # Settings are per server: never inherit another server's published HACK options.
        env.pop("SGLANG_HACK_ENGINE", None)
        # A CPU server (--device cpu): SGLang's CPU engine from the first import, as `hack up`'s
        # servers get it (disagg.cluster.server_env); the plugin would switch it on later anyway.
        env.setdefault(CPU_ENGINE_ENV, "1")
        Path(self.log_path).write_bytes(b"")
        pid, why_not = server_zygote.spawn_or_none(self.command(), env, self.log_path)
        if pid is not None:
            self.proc = server_zygote.ZygoteChild(pid, os.environ[server_zygote.ENV])
            return self
        if os.environ.get(server_zygote.ENV):  # asked for, refused: say why where it is read
            Path(self.log_path).write_text(f"sglang-hack: started without the server zygote: {why_not}\n")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        return self

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = Path(self.log_path).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> "SGLangServer":
        """Wait until the server answers /model_info and finished its warmup (/health 200)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200 and \
                        "fired up and ready" in Path(self.log_path).read_text(errors="replace"):
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.25)
        self.stop()
        raise ServerStartError(f"server not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def wait_exit(self, timeout: float) -> int:
        """For servers expected to refuse their options: the exit code (killed on timeout)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server's launcher, which stops its children itself (about 2.6 s for a
        SmolLM2 server); what is left of its process group after that, or after `timeout`, is
        killed. SIGTERM to the whole group made each child exit first and the launcher took it
        for a crash (5 s of crash diagnostics per stop)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # the children left in its group (all of them when the launcher did not exit)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=timeout)

    # ---- requests ------------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], max_new_tokens: int, timeout: float = 900.0,
                 **sampling: Any) -> dict:
        """Greedy /generate; returns the JSON (text, output_ids, meta_info)."""
        key = "input_ids" if isinstance(prompt, list) else "text"
        body = {key: prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                                  **sampling}}
        r = requests.post(self.url + "/generate", json=body, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def timed_stream(self, ids: list[int], n: int, timeout: float = 3600.0) -> dict:
        """One streamed greedy request of exactly n tokens: time to first token, prefill
        tokens/s (prompt / time to first token) and decode tokens/s from the first streamed
        token to the last."""
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}}
        t0 = time.perf_counter()
        stamps: list[tuple[float, int]] = []
        with requests.post(self.url + "/generate", json=body, stream=True, timeout=timeout) as r:
            r.raise_for_status()
            for chunk in stream_chunks(r):
                meta = chunk["meta_info"]
                stamps.append((time.perf_counter(), int(meta["completion_tokens"])))
        if len(stamps) < 2 or stamps[-1][1] <= stamps[0][1]:
            raise RuntimeError(f"the server streamed {len(stamps)} chunks for {n} tokens")
        (t_first, n_first), (t_last, n_last) = stamps[0], stamps[-1]
        return {"ttft_s": t_first - t0, "prefill_tok_s": len(ids) / (t_first - t0),
                "decode_tok_s": (n_last - n_first) / (t_last - t_first), "tokens": n_last}

    def timed_streams(self, ids: list[int], n: int, count: int, timeout: float = 3600.0) -> dict:
        """`count` streamed greedy requests of exactly n tokens on the same prompt at once (a
        cached prompt shares its pages: the batch fits where one request does): decode tokens/s
        of the whole batch, counted between the moment every stream has its first token and the
        moment the first stream ends (the window where all `count` decode together)."""
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}}
        stamps: list[list[tuple[float, int]]] = [[] for _ in range(count)]
        errors: list[str] = []

        def one(i: int) -> None:
            try:
                with requests.post(self.url + "/generate", json=body, stream=True, timeout=timeout) as r:
                    r.raise_for_status()
                    for chunk in stream_chunks(r):
                        stamps[i].append((time.perf_counter(), int(chunk["meta_info"]["completion_tokens"])))
            except Exception as exc:  # reported below, after every stream has ended
                errors.append(f"{type(exc).__name__}: {exc}"[:200])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors or any(len(s) < 2 for s in stamps):
            raise RuntimeError(f"{count} concurrent streams of {n} tokens: {errors or 'a stream sent under two chunks'}")
        return batch_decode_rate(stamps)

    def kv_usage(self) -> dict:
        info = requests.get(self.url + "/server_info", timeout=30).json()
        return info["internal_states"][0]["hack_kv"]

    def server_info(self) -> dict:
        return requests.get(self.url + "/server_info", timeout=30).json()

    def flush_cache(self) -> None:
        requests.post(self.url + "/flush_cache", timeout=30).raise_for_status()


def batch_decode_rate(stamps: list[list[tuple[float, int]]]) -> dict:
    """Decode tokens/s of streams that ran at once, from each stream's (time, tokens so far)
    stamps: the tokens all of them received between the last first token and the first last
    token, over that window; None (with why) when the window is empty."""
    t_start = max(s[0][0] for s in stamps)
    t_end = min(s[-1][0] for s in stamps)
    if t_end <= t_start:
        return {"batch": len(stamps), "decode_tok_s": None, "window_s": 0.0,
                "why": "a stream ended before the last one began decoding (the batch never ran together)"}
    tokens = sum(_tokens_at(s, t_end) - _tokens_at(s, t_start) for s in stamps)
    return {"batch": len(stamps), "decode_tok_s": tokens / (t_end - t_start), "window_s": t_end - t_start}


def _tokens_at(stamps: list[tuple[float, int]], t: float) -> int:
    """Tokens a stream had received by time t (its stamps: (time, completion tokens so far))."""
    got = 0
    for when, n in stamps:
        if when > t:
            break
        got = n
    return got
