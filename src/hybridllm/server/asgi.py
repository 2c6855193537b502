"""What the server's pure ASGI middlewares share: answering with an OpenAI error object."""

from __future__ import annotations

import json
from typing import Any


async def send_error(send: Any, status: int, body: dict[str, Any]) -> None:
    """Answer an HTTP request with ``status`` and the JSON ``body``, closing the connection."""
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})
