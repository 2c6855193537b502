"""What the server's pure ASGI middlewares share: answering with an OpenAI error object."""

from __future__ import annotations

import json
from typing import Any


async def send_error(send: Any, status: int, body: dict[str, Any], headers: dict[str, str] | None = None,
                     close: bool = True) -> None:
    """Answer an HTTP request with ``status`` and the JSON ``body`` (and ``headers``), closing
    the connection unless ``close`` is False."""
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in (headers or {}).items()]
    if close:
        raw.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
