"""engine/sigterm.py: a SIGTERM's flag is noticed within a poll, then the upstream watchdog runs."""
from __future__ import annotations

import asyncio
import time

from engine.sigterm import notice_then_drain


class _Manager:
    gracefully_exit = False


def test_the_upstream_watchdog_runs_once_the_flag_is_set_and_not_before():
    manager, calls = _Manager(), []

    async def original(m):
        calls.append((m, m.gracefully_exit, time.monotonic()))

    async def scenario():
        task = asyncio.create_task(notice_then_drain(original, manager, poll_s=0.01))
        await asyncio.sleep(0.2)
        assert calls == [] and not task.done()  # no SIGTERM yet: the watchdog keeps waiting
        set_at = time.monotonic()
        manager.gracefully_exit = True  # what SGLang's SIGTERM handler does
        await asyncio.wait_for(task, timeout=5)
        return set_at

    set_at = asyncio.run(scenario())
    assert len(calls) == 1 and calls[0][0] is manager and calls[0][1] is True
    assert calls[0][2] - set_at < 0.5  # upstream alone looks every 5 s


def test_a_flag_already_set_drains_at_once():
    manager, calls = _Manager(), []
    manager.gracefully_exit = True

    async def original(m):
        calls.append(m)

    asyncio.run(asyncio.wait_for(notice_then_drain(original, manager), timeout=1))
    assert calls == [manager]
