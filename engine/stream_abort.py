"""The abort task SGLang 0.5.23 attaches to every streamed generation (TokenizerManager.
create_abort_task: after the stream ends it aborts the request's ids still running) reads
`obj.is_single`, which a request refused while it was being read never gets (SGLang sets it in
GenerateReqInput._determine_batch_size, after its first checks). The task then raises after the
response was sent, and the HTTP server closes the connection: a client that keeps connections
alive finds its next request on that connection broken (found by schema fuzzing: a request
after a refused streamed one read as a dropped connection).

`skip_unread` wraps the task (an AROUND row of engine.hooks): a request that was never read
never reached the scheduler, so there is nothing to abort.
"""
from __future__ import annotations

from typing import Any, Callable


def skip_unread(original: Callable[..., Any], manager: Any, obj: Any) -> Any:
    from starlette.background import BackgroundTasks

    upstream = original(manager, obj)

    async def abort_if_read() -> None:
        if hasattr(obj, "is_single"):
            await upstream()

    tasks = BackgroundTasks()
    tasks.add_task(abort_if_read)
    return tasks
