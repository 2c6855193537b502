"""What every route of one app shares: the engine, its read-only view, the metrics and the settings.

:func:`~hybridllm.server.app.create_app` builds one :class:`ServerContext` and keeps it as
``app.state.context``; a route gets it with ``Depends(server_context)``, and the ``/v1`` and
tokenizer routes check the API key with ``Depends(require_api_key)``. Two apps in one process
have two contexts: nothing is global.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from hybridllm.engine.scheduler import Scheduler
from hybridllm.server.engine_view import EngineView
from hybridllm.server.logprobs import TokenText
from hybridllm.server.metrics import ServerMetrics
from hybridllm.server.protocol import APIError
from hybridllm.server.shutdown import Draining
from hybridllm.server.stats import ServerStats


@dataclass
class ServerContext:
    """One app's engine and settings.

    Attributes:
        llm: the loaded model (tokenizer, chat template).
        scheduler: the request loop requests are submitted to (and aborted from).
        view: the read-only view of the engine (``/stats``, ``/metrics``, ``/health``).
        metrics: the Prometheus registry and the loop's observer.
        stats: the ``/stats`` body.
        model_name: the served model id.
        aliases: every name a request may give the model.
        api_key: the key ``/v1`` routes need (None: open).
        fingerprint: the build's ``system_fingerprint``.
        created: when the app was built (Unix seconds; the model card's ``created``).
        draining: the switch SIGTERM turns on.
        stream_stall_timeout_s: how long a paused stream waits for its client to read.
        token_text: each token id's text and bytes (log-probabilities), from the tokenizer.
    """

    llm: Any
    scheduler: Scheduler
    view: EngineView
    metrics: ServerMetrics
    stats: ServerStats
    model_name: str
    aliases: frozenset[str]
    api_key: str | None
    fingerprint: str
    created: int
    draining: Draining
    stream_stall_timeout_s: float
    token_text: TokenText = field(init=False)

    def __post_init__(self) -> None:
        self.token_text = TokenText(self.llm.tokenizer, raw_bytes=self.scheduler.token_raw_bytes)

    def check_model(self, name: str) -> None:
        """400 unless ``name`` is one of the served model's names."""
        if name not in self.aliases:
            raise APIError(400, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")


def server_context(request: Request) -> ServerContext:
    """The context of the app answering ``request`` (a FastAPI dependency)."""
    return request.app.state.context


async def require_api_key(request: Request) -> None:
    """401 unless the request carries ``Authorization: Bearer <key>`` (when the app has a key)."""
    api_key = server_context(request).api_key
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "invalid or missing API key: send it as 'Authorization: Bearer <key>'",
                       type="authentication_error", code="invalid_api_key")
