"""``GET /v1/models`` and ``GET /v1/models/{id}``: the served model's card."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from hybridllm.server.context import ServerContext, require_api_key, server_context
from hybridllm.server.protocol import ERROR_RESPONSES, APIError, ErrorResponse, ModelCard, ModelList

router = APIRouter(dependencies=[Depends(require_api_key)])


def model_card(ctx: ServerContext) -> dict[str, Any]:
    return ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=ctx.scheduler.context_length).model_dump()


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES, summary="The served model")
async def models(ctx: ServerContext = Depends(server_context)) -> Any:
    return {"object": "list", "data": [model_card(ctx)]}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard,
            responses={**ERROR_RESPONSES, 404: {"model": ErrorResponse, "description": "Unknown model id"}},
            summary="One model (404 for an id this server does not serve)")
async def model(model_id: str, ctx: ServerContext = Depends(server_context)) -> Any:
    if model_id not in ctx.aliases:
        raise APIError(404, f"the model '{model_id}' does not exist; this server serves '{ctx.model_name}'",
                       param="model", code="model_not_found")
    return model_card(ctx)
