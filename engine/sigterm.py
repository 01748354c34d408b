"""A SIGTERM noticed within a fraction of a second instead of up to five.

SGLang's tokenizer manager learns of a SIGTERM from a flag its signal handler sets, and a watchdog
coroutine (`TokenizerManager.sigterm_watchdog`) looks at that flag every 5 s before it drains the
requests and stops the scheduler. So every stop of a server (`hack down`, a stopped `hack up`,
each test that starts one) waited 2.5 s on average doing nothing. The hook below waits for the
flag at POLL_S and then runs the upstream watchdog, which finds the flag set and drains as before
(requests still in flight are waited for exactly as upstream waits for them).
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

POLL_S = 0.1


async def notice_then_drain(original: Callable[[Any], Awaitable[None]], manager: Any,
                            poll_s: float = POLL_S) -> None:
    """Wait for `manager.gracefully_exit`, looking every `poll_s`, then run `original(manager)`."""
    while not manager.gracefully_exit:
        await asyncio.sleep(poll_s)
    await original(manager)
