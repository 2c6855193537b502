"""Request and response bodies of the OpenAI-compatible API, and its error objects.

Requests are validated strictly (a string where a number belongs is an error, not coerced), and
text must be valid Unicode (a lone UTF-16 surrogate such as ``"\\ud800"`` anywhere in a body is a
400 naming where). Fields the models do not declare land in ``model_extra``: OpenAI fields this
server does not implement are refused there with a 400 naming them (the table in
:mod:`hybridllm.server.unsupported`); any other key, not OpenAI's at all, is served without it
(clients and SDKs send their own extras) and named in the log once per request, as vLLM does
(:func:`ignored_fields` lists them, nested ones included). Beyond OpenAI's fields, a few of vLLM's sampling extras are
accepted (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``; pass them with the
client's ``extra_body``), and llama.cpp's ``repeat_penalty`` (an alias of ``repetition_penalty``).
``speculative`` (ours): ``false`` decodes the request without speculative decoding when the server
runs with ``--spec`` (the text is the same either way; the usage's ``completion_tokens_details``
reports the proposals).
``response_format`` and ``tools``/``tool_choice`` are OpenAI's; see :mod:`hybridllm.server.tools`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from hybridllm.config import StructuredOutput

_REQUEST_CONFIG = ConfigDict(strict=True, extra="ignore")
# a request's top level keeps undeclared keys, so unsupported OpenAI fields can be refused by name
_TOP_REQUEST_CONFIG = ConfigDict(strict=True, extra="allow")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
RETRY_AFTER_S = 1  # the Retry-After of every 503
INVALID_UNICODE = "invalid_unicode"  # the validation error type of a lone surrogate


# ---- errors ------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class APIError(Exception):
    """An error answered with an OpenAI-style error object.

    Args:
        status: HTTP status.
        message: what went wrong and what to do.
        type: OpenAI's error type ("invalid_request_error", "authentication_error", ...).
        param: the request field at fault.
        code: a machine-readable code.
        headers: extra response headers (e.g. Retry-After).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# the error answers every API route documents in the OpenAPI schema
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    413: {"model": ErrorResponse, "description": "Request body over the size limit"},
    503: {"model": ErrorResponse, "description": "Queue full or shutting down (see Retry-After)"},
}


# ---- request models: valid Unicode, ignored fields noted -----------------------------------
def find_lone_surrogate(value: Any, path: str = "") -> tuple[str, str] | None:
    """The (path, character) of the first lone UTF-16 surrogate in a JSON value's strings (keys
    included), or None. Such a string cannot be encoded as UTF-8, so no tokenizer takes it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return path or "the body", f"\\u{ord(value[exc.start]):04x}"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = find_lone_surrogate(key, path or "the body") or find_lone_surrogate(
                item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if found := find_lone_surrogate(item, f"{path}.{i}" if path else str(i)):
                return found
    return None


class RequestModel(BaseModel):
    """A request body (or a part of one): keys it does not declare are ignored but remembered,
    for :func:`ignored_fields`."""

    model_config = _REQUEST_CONFIG
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _remember_ignored(cls, data: Any, handler: Any) -> Any:
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, RequestModel) and cls.model_config.get("extra") == "ignore":
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            model._ignored = tuple(key for key in data if key not in known)
        return model


class TopRequestModel(RequestModel):
    """A whole request body: its text checked for lone surrogates before anything else."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = find_lone_surrogate(data)
        if found is not None:
            path, char = found
            raise PydanticCustomError(INVALID_UNICODE, "{path} holds a lone surrogate ({char}), which is not valid "
                                      "Unicode text; send UTF-8 text", {"path": path, "char": char})
        return data


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The keys of a parsed request that no model declares (dotted paths; a top-level model's
    ``model_extra`` included): what the server served the request without."""
    out = [prefix + key for key in (model.model_extra or {})] if model.model_config.get("extra") == "allow" else []
    if isinstance(model, RequestModel):
        out += [prefix + key for key in model._ignored]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if isinstance(item, BaseModel):
                out += ignored_fields(item, f"{prefix}{name}." if index is None else f"{prefix}{name}.{index}.")
    return out


# ---- requests ----------------------------------------------------------------------------
class StreamOptions(RequestModel):
    model_config = _REQUEST_CONFIG
    include_usage: bool = False


class TextPart(RequestModel):
    model_config = _REQUEST_CONFIG
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    model_config = _REQUEST_CONFIG
    name: str
    arguments: str = Field(description="The arguments as a JSON string.")


class ToolCall(RequestModel):
    """A call the assistant made (in a reply, or in the history sent back)."""

    model_config = _REQUEST_CONFIG
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    model_config = _REQUEST_CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates take it (Hugging Face's convention: a call's arguments
        as an object, the answered call's id on a tool message)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _json_or_text(call.function.arguments)}}
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(RequestModel):
    model_config = _REQUEST_CONFIG
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="A JSON schema of the arguments.")
    strict: bool | None = None


class ToolDefinition(RequestModel):
    model_config = _REQUEST_CONFIG
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    model_config = _REQUEST_CONFIG
    name: str


class NamedToolChoice(RequestModel):
    """``tool_choice`` naming the function to call."""

    model_config = _REQUEST_CONFIG
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(RequestModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema", description="Absent: any JSON value.")
    strict: bool | None = None


class TextResponseFormat(RequestModel):
    model_config = _REQUEST_CONFIG
    type: Literal["text"]


class JSONObjectResponseFormat(RequestModel):
    model_config = _REQUEST_CONFIG
    type: Literal["json_object"]


class JSONSchemaResponseFormat(RequestModel):
    model_config = _REQUEST_CONFIG
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    TextResponseFormat | JSONObjectResponseFormat | JSONSchemaResponseFormat, Field(discriminator="type")
]


def structured_output(response_format: ResponseFormat | None) -> StructuredOutput | None:
    """The constraint a ``response_format`` asks for (None: free text)."""
    if isinstance(response_format, JSONObjectResponseFormat):
        return StructuredOutput({"type": "object"})
    if isinstance(response_format, JSONSchemaResponseFormat):
        schema = response_format.json_schema.json_schema
        return StructuredOutput({} if schema is None else schema)
    return None


class SamplingFields(TopRequestModel):
    """Fields shared by chat and text completions."""

    model_config = _TOP_REQUEST_CONFIG
    model: str
    max_tokens: int | None = Field(default=None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(default=None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1, description="Completions to generate; they share the prompt's KV.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX, description="A 64-bit signed integer.")
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(default=None, description="Token id -> bias in [-100, 100].")
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1, description="0 or -1 disables.")
    min_p: float | None = Field(default=None, ge=0, lt=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    ignore_eos: bool | None = False
    # llama.cpp's name of repetition_penalty
    repeat_penalty: float | None = Field(default=None, gt=0, description="Alias of repetition_penalty.")
    response_format: ResponseFormat | None = Field(
        default=None, description="text, json_object, or json_schema: the reply is constrained by a grammar.")
    # ours
    speculative: bool | None = Field(
        default=None, description="false: no speculative decoding for this request (when the server runs with "
                                  "--spec); the text is the same either way, only the speed differs.")


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1, description="Alias of max_tokens.")
    logprobs: bool | None = Field(default=None, description="Return each generated token's log-probability.")
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="Alternatives per token (needs logprobs).")
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="none, auto (the default with tools), required, or a named function.")
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one call per reply.")


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0, description="Most tokens to generate (0 with echo).")
    echo: bool | None = Field(default=None, description="Return the prompt before the completion.")
    logprobs: int | None = Field(default=None, ge=0, le=20,
                                 description="Log-probabilities with this many alternatives per token.")


# ---- responses ---------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens whose KV came from the prefix cache (not prefilled).")


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = Field(description="Tokens proposed by speculative decoding that the model "
                                                        "accepted (OpenAI's name for predicted tokens).")
    rejected_prediction_tokens: int = Field(description="Proposed tokens the model rejected.")
    speculative_drafts: int = Field(description="Proposals verified (ours).")
    speculative_draft_tokens: int = Field(description="Tokens proposed and verified (ours).")
    speculative_acceptance_rate: float | None = Field(description="Accepted over proposed tokens; null without "
                                                                  "proposals (ours).")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    """The legacy shape: one entry per position (``null`` where none, as the first prompt token)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hybridllm"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: str
    running: int
    waiting: int


# ---- llama.cpp's tokenizer endpoints, /version -------------------------------------------
class TokenizeRequest(TopRequestModel):
    """``POST /tokenize`` (llama.cpp's shape)."""

    model_config = _REQUEST_CONFIG
    content: str
    add_special: bool = Field(default=False, description="Add the model's BOS token (when it uses one).")
    with_pieces: bool = Field(default=False, description="Return {id, piece} objects instead of ids.")


class TokenPiece(BaseModel):
    id: int
    piece: str | list[int] = Field(description="The token's text, or its bytes when they are not valid UTF-8 alone.")


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[TokenPiece]


class DetokenizeRequest(TopRequestModel):
    """``POST /detokenize`` (llama.cpp's shape)."""

    model_config = _REQUEST_CONFIG
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    content: str


class VersionInfo(BaseModel):
    version: str
    system_fingerprint: str
    model: str
    weights_format: str
