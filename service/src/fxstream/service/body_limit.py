"""A cap on REST request bodies, enforced before a body is held in memory.

An ASGI middleware: a request whose ``Content-Length`` is above the cap is
answered 413 at once, its body never read; a body without a length (chunked)
is counted as it streams in, and the read that passes the cap ends the request
with 413. The cap is the API's ``--max-body-bytes`` setting (environment
``FXSTREAM_API_MAX_BODY_BYTES``), and the 413 names it.
"""

from __future__ import annotations

import json
from typing import Final

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_BODY_ENV",
    "MAX_BODY_OPTION",
    "BodyLimit",
    "too_large_detail",
]

DEFAULT_MAX_BODY_BYTES: Final = 16 * 1024 * 1024
"""The default cap: a 4 MiB function (the functions topic's limit) in base64 JSON fits."""
MAX_BODY_OPTION: Final = "--max-body-bytes"
MAX_BODY_ENV: Final = "FXSTREAM_API_MAX_BODY_BYTES"


def too_large_detail(limit: int, size: int | None = None) -> str:
    """The 413's words: the cap, and the setting that raises it."""
    what = f"the request body ({size:,} bytes)" if size is not None else "the request body"
    return (
        f"{what} is larger than this API accepts ({limit:,} bytes); send less (large "
        f"arguments travel by reference), or raise the cap with {MAX_BODY_OPTION} "
        f"(environment {MAX_BODY_ENV}) on fxstream-service api"
    )


class BodyLimit:
    """Answers 413 to a request body above ``max_body_bytes`` (see the module notes)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_body_bytes < 0:
            raise ValueError(f"max_body_bytes must be 0 or more, not {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the declared length, then count what streams in."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _reject(send, too_large_detail(limit, declared))
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # Raised inside the route's body read: the app's HTTP error handler
                    # answers 413 in the API's error format; the rest is never read.
                    raise HTTPException(413, too_large_detail(limit))
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _reject(send: Send, detail: str) -> None:
    body = json.dumps({"error": "body-too-large", "detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
