"""Chat templates: render a model's Jinja2 chat template the way Hugging Face transformers does.

A chat template turns a list of ``{"role": ..., "content": ...}`` messages into the prompt text the
model was fine-tuned on. Templates come with the model (GGUF ``tokenizer.chat_template``,
``tokenizer_config.json`` or ``chat_template.jinja``) and are untrusted code, so they run in Jinja's
immutable sandbox. The environment mirrors transformers' (``trim_blocks``, ``lstrip_blocks``, the
``raise_exception`` and ``strftime_now`` globals, a ``tojson`` that does not HTML-escape, loop
controls and a pass-through ``{% generation %}`` block) so that the rendered text is identical.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hybridllm.errors import HybridLLMError

__all__ = ["ChatTemplate", "validate_messages"]


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: rendered as its body.

    transformers uses the tag to find assistant tokens for training masks; for inference the body
    is all that matters, but a template using the tag must still parse.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _plain(value: Any) -> Any:
    """A copy of ``value`` made of plain JSON-like types, so the template cannot reach live objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return f"<{type(value).__name__}>"


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a conversation and return a plain copy ready for a template.

    Every message must be a mapping with a non-empty string ``role`` and a ``content`` (a string,
    or a list of content parts). ``content`` may be ``None`` only on a message carrying
    ``tool_calls``. As in transformers, keys whose value is ``None`` are dropped.

    Args:
        messages: The conversation, oldest message first.

    Returns:
        A list of fresh dicts holding only plain JSON-like values.

    Raises:
        HybridLLMError: If the conversation is empty or a message is malformed.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise HybridLLMError(f"chat messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise HybridLLMError("cannot apply a chat template to an empty conversation")
    plain = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise HybridLLMError(f"chat message {index} must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise HybridLLMError(f"chat message {index} has no 'role' (a non-empty string)")
        if "content" not in message:
            raise HybridLLMError(f"chat message {index} ({role}) has no 'content'")
        content = message["content"]
        if content is None and not message.get("tool_calls"):
            raise HybridLLMError(f"chat message {index} ({role}) has content None and no tool_calls")
        if content is not None and not isinstance(content, (str, list, tuple)):
            raise HybridLLMError(
                f"chat message {index} ({role}) content must be a string or a list, got {type(content).__name__}"
            )
        plain.append({key: _plain(value) for key, value in message.items() if value is not None})
    return plain


class ChatTemplate:
    """A compiled chat template.

    Compilation happens on first use, so a model whose template does not parse still loads and
    tokenizes; the error surfaces when a chat is rendered.

    Args:
        source: The Jinja2 source of the template.
        special_tokens: Token strings the template may reference, e.g. ``{"bos_token": "<s>"}``.
            Entries whose value is ``None`` are left undefined.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise HybridLLMError("chat template must be a non-empty string")
        self.source = source
        self._special_tokens = {key: value for key, value in (special_tokens or {}).items() if value is not None}
        self._compiled: jinja2.Template | None = None

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            try:
                self._compiled = _make_environment().from_string(self.source)
            except jinja2.exceptions.TemplateError as exc:
                raise HybridLLMError(f"the model's chat template does not parse: {exc}") from exc
        return self._compiled

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        extra_context: Mapping[str, Any] | None = None,
    ) -> str:
        """Render a conversation to prompt text.

        Args:
            messages: The conversation; see :func:`validate_messages`.
            add_generation_prompt: Whether to end with the header that opens the assistant's turn.
            extra_context: More variables for the template (e.g. ``tools``, ``enable_thinking``);
                they override the special tokens of the same name.

        Returns:
            The rendered prompt.

        Raises:
            HybridLLMError: If the messages are invalid or the template fails (including its own
                ``raise_exception`` calls).
        """
        plain_messages = validate_messages(messages)
        context: dict[str, Any] = {"tools": None, "documents": None, **self._special_tokens}
        context.update(_plain(dict(extra_context or {})))
        template = self._template()
        try:
            return template.render(messages=plain_messages, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as exc:
            raise HybridLLMError(f"chat template error: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise HybridLLMError(f"chat template failed on these messages: {exc}") from exc
