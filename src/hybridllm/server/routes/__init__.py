"""The server's routers, one concern each: the OpenAI API (:mod:`.chat`, :mod:`.completions`,
:mod:`.models`), the utility routes (:mod:`.utility`: tokenizer, version, health, metrics) and the
page with its ``/stats`` (:mod:`.page`). Each route gets the app's
:class:`~hybridllm.server.context.ServerContext` as a dependency."""

from fastapi import APIRouter

from hybridllm.server.routes import chat, completions, models, page, utility

ROUTERS: tuple[APIRouter, ...] = (chat.router, completions.router, models.router, utility.tokenizer_router,
                                  utility.router, page.router)

__all__ = ["ROUTERS"]
