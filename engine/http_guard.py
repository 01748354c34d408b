"""An ASGI middleware on SGLang's HTTP app: a generation request whose body is not a JSON object,
or whose fields SGLang would answer with a 500, gets a 400 naming the field before FastAPI parses
it (engine.request_checks: body_shape_error, body_field_error).

Pure ASGI rather than Starlette's BaseHTTPMiddleware so that streamed responses and client
disconnects pass through untouched: the body is read once, checked, and replayed to the app.
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from .request_checks import GENERATION_PATHS, body_field_error, body_shape_error

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class JsonObjectGuard:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope.get("type") != "http" or scope.get("method") not in ("POST", "PUT")
                or scope.get("path") not in GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived: nothing to answer
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        error = body_shape_error(body) or body_field_error(scope["path"], body)
        if error is not None:
            await _send_400(send, error)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later reads wait for the disconnect, as upstream expects

        await self.app(scope, replay, send)


async def _send_400(send: Send, message: str) -> None:
    # SGLang's own error shape (ErrorResponse), so clients parse it like its other 400s
    payload = json.dumps({"object": "error", "message": message, "type": "BadRequest",
                          "param": None, "code": 400}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def install(app: Any) -> bool:
    """Add the guard to a FastAPI/Starlette app once (before it starts); True when added."""
    if getattr(app.state, "hack_json_guard", False):
        return False
    app.add_middleware(JsonObjectGuard)
    app.state.hack_json_guard = True
    return True
