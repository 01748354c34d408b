"""Reading a streamed `/generate` answer: SGLang sends server-sent events, one `data: {json}`
line per chunk, then `data: [DONE]`. One reader for every client (the server launcher's timed
requests, the PD replay)."""
from __future__ import annotations

import json
from typing import Any, Iterator


def stream_chunks(response: Any) -> Iterator[dict]:
    """The JSON chunks of a streamed answer (a `requests` response opened with stream=True), in
    order, up to `[DONE]`; lines that are not data lines are skipped."""
    for line in response.iter_lines():
        if not line or not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)
