"""OpenAI request fields this server does not implement: one table, refused with 400.

A field in :data:`UNSUPPORTED_FIELDS` that a request sets to anything but one of its neutral
values (the ones that ask for nothing: ``tools: []``, ``tool_choice: "none"``,
``response_format: {"type": "text"}``...) is answered with a 400 OpenAI error object whose
``param`` names it, never silently ignored. Keys that are not OpenAI's at all (a client's own
extras) are served without, and :func:`log_ignored_fields` names them in the log once per request
(a warning, as vLLM does).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from hybridllm.server.protocol import APIError, ignored_fields

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnsupportedField:
    """One OpenAI field the server refuses.

    Attributes:
        name: the request key.
        neutral: values that ask for nothing (accepted; ``None`` always is).
        why: what the client should know, in a few words.
    """

    name: str
    neutral: tuple[Any, ...]
    why: str


# Fields a request model declares never reach this table (response_format everywhere; tools,
# tool_choice and parallel_tool_calls on chat); on /v1/completions the tool fields are refused here.
UNSUPPORTED_FIELDS: tuple[UnsupportedField, ...] = (
    UnsupportedField("tools", ([],), "tool calling is on /v1/chat/completions"),
    UnsupportedField("tool_choice", ("none", "auto"), "tool calling is on /v1/chat/completions"),
    UnsupportedField("functions", ([],), "the legacy function calling; use tools"),
    UnsupportedField("function_call", ("none", "auto"), "the legacy function calling; use tool_choice"),
    UnsupportedField("parallel_tool_calls", (True, False), "tool calling is on /v1/chat/completions"),
    UnsupportedField("modalities", (["text"],), "output modalities other than text"),
    UnsupportedField("audio", (), "audio output"),
    UnsupportedField("prediction", (), "predicted outputs"),
    UnsupportedField("web_search_options", (), "web search"),
    UnsupportedField("suffix", ("",), "insertion after the completion"),
    UnsupportedField("best_of", (1,), "best_of above 1; n returns several completions"),
)


def refuse_unsupported(extra: Mapping[str, Any] | None) -> None:
    """Raise a 400 :class:`APIError` naming the first unsupported field set to a non-neutral value.

    Args:
        extra: the request's keys that its model does not declare (``model.model_extra``).
    """
    if not extra:
        return
    for field in UNSUPPORTED_FIELDS:
        value = extra.get(field.name)
        if value is None or any(type(value) is type(ok) and value == ok for ok in field.neutral):
            continue
        raise APIError(400, f"{field.name} is not supported by this server ({field.why}); remove it from "
                       f"the request", param=field.name, code="unsupported_parameter")


def log_ignored_fields(body: BaseModel, route: str) -> list[str]:
    """Name, in one warning, the request's fields that no model declares (nested ones as dotted
    paths) and that the request is served without; returns them."""
    names = ignored_fields(body)
    if names:
        logger.warning("%s: the following fields were present in the request but ignored: %s", route,
                       ", ".join(names))
    return names
