"""Ports for servers that bind them later (engine.launcher.free_port) and the startup wait that
gives up at once when a server could not listen (disagg.cluster.wait_healthy)."""
from __future__ import annotations

import subprocess
import time

import pytest

from disagg import cluster
from engine import launcher


def test_ports_come_from_below_the_ephemeral_range_and_never_twice():
    low = launcher._ephemeral_low()
    ports = [launcher.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if low > launcher.PORT_RANGE_LOW + 64:
        assert all(launcher.PORT_RANGE_LOW <= p < low for p in ports), ports


def test_without_room_the_os_picks(monkeypatch):
    monkeypatch.setattr(launcher, "_ephemeral_low", lambda: launcher.PORT_RANGE_LOW)
    p = launcher.free_port()
    assert 0 < p < 65536 and p in launcher._handed_out


def test_wait_healthy_gives_up_at_once_when_a_server_cannot_bind(tmp_path):
    log = tmp_path / "decode-0.log"
    log.write_text("INFO: Application startup complete.\n"
                   "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 45033): "
                   "address already in use\nINFO:     Waiting for application shutdown.\n")
    alive = subprocess.Popen(["sleep", "60"])  # SGLang's process stays up after the failed bind
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="could not listen on its port .*45033"):
            cluster.wait_healthy(["http://127.0.0.1:9/health"], [alive.pid], 600, [log])
        assert time.monotonic() - t0 < 10
    finally:
        alive.kill()
        alive.wait()
