"""Errors on SGLang 0.5.23's Ollama-compatible endpoints (/api/chat, /api/generate) answered the
way its other endpoints answer them: SGLang's Ollama handlers catch nothing, so a request SGLang
itself refuses (a ValueError: an empty conversation, a negative num_predict, a temperature below
0, ...) was a 500, and when streamed (Ollama's default) the connection broke off after the 200,
since the request is only checked when its stream is first read (found by schema fuzzing of
the server's OpenAPI document).

`answer_errors` wraps both handlers (an AROUND row of engine.hooks): a ValueError becomes a 400
with Ollama's error body ({"error": "..."}); a stream is read up to its first chunk before it is
answered, so the same errors get the same 400; an error after the first chunk ends the stream
with an error line, as Ollama's own server does, instead of a broken connection.
"""
from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

logger = logging.getLogger(__name__)


def error_response(status: int, message: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status)


def error_line(message: str) -> bytes:
    return json.dumps({"error": message}).encode() + b"\n"


async def answer_errors(original: Callable[..., Awaitable[Any]], self: Any, request: Any,
                        raw_request: Any) -> Any:
    from fastapi.responses import StreamingResponse

    try:
        response = await original(self, request, raw_request)
    except ValueError as exc:
        return error_response(400, str(exc))
    if not isinstance(response, StreamingResponse):
        return response
    chunks = response.body_iterator
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = None
    except ValueError as exc:
        return error_response(400, str(exc))
    response.body_iterator = _continue(first, chunks)
    return response


async def _continue(first: Any, chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is None:
        return
    yield first
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:  # noqa: BLE001 - after the 200 the stream can only say it in a line
        logger.warning("sglang-hack: Ollama stream ended by an error: %s", exc)
        yield error_line(str(exc))
