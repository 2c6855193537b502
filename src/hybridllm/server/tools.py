"""Tool calling for the chat API: tools into the prompt, forced calls through the grammar, calls
out of the model's text.

One call format: a JSON object ``{"name": <function name>, "arguments": {...}}``.

* The tools go to the model's chat template as ``tools=`` (templates made for tool use render
  them in their own words). A template that ignores them (it renders the same prompt with and
  without) gets them in a system message that asks for the call format above.
* ``tool_choice`` "required" or a named function forces a call: the reply is constrained by a JSON
  schema (the call object, with ``arguments`` following the function's ``parameters``).
* Replies are parsed into OpenAI's ``tool_calls``: a reply that is a call object, or call objects
  inside ``<tool_call>...</tool_call>`` tags (the Hermes/Qwen convention many tool-use templates
  teach), naming one of the request's tools.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["forced_call_schema", "parse_tool_calls", "render_with_tools", "tools_system_prompt"]

_TAGGED_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call of ``function`` (an OpenAI function definition)."""
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": function.get("parameters") or ANY_OBJECT},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_call_schema(functions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The schema a forced reply follows: a call of one of ``functions``."""
    if len(functions) == 1:
        return call_schema(functions[0])
    return {"anyOf": [call_schema(function) for function in functions]}


def tools_system_prompt(functions: Sequence[Mapping[str, Any]]) -> str:
    """The tools in words, for a chat template that does not render ``tools``."""
    listing = "\n".join(json.dumps(function, ensure_ascii=False) for function in functions)
    return (
        "You can call these functions:\n"
        f"{listing}\n"
        'To call one, reply with only a JSON object {"name": <the function name>, "arguments": '
        "<its arguments as a JSON object>}."
    )


def render_with_tools(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """The prompt text of ``messages`` with ``tools`` (OpenAI tool definitions) offered to the model.

    Raises:
        HybridLLMError: If the chat template fails on the messages.
    """
    with_tools = tokenizer.apply_chat_template(messages, extra_context={"tools": tools})
    if with_tools != tokenizer.apply_chat_template(messages):
        return with_tools  # the template renders the tools itself
    note = tools_system_prompt([tool["function"] for tool in tools])
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}
        return tokenizer.apply_chat_template([first, *messages[1:]])
    return tokenizer.apply_chat_template([{"role": "system", "content": note}, *messages])


def _call_objects(text: str) -> list[Any]:
    """The JSON values a reply holds as calls: tagged blocks, else the whole reply."""
    blocks = _TAGGED_CALL.findall(text)
    candidates = blocks if blocks else [text.strip()]
    values = []
    for candidate in candidates:
        try:
            values.append(json.loads(candidate))
        except ValueError:
            return []  # one unreadable block: the reply is text, not calls
    return values


def parse_tool_calls(text: str, names: Sequence[str]) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` of a reply, or [] when the reply is not (only) calls of ``names``.

    Args:
        text: the model's reply.
        names: the functions the request offered.

    Returns:
        ``[{"id", "type": "function", "function": {"name", "arguments" (a JSON string)}}, ...]``.
    """
    calls = []
    for value in _call_objects(text):
        if isinstance(value, list):
            items = value
        else:
            items = [value]
        for item in items:
            if not (isinstance(item, dict) and item.get("name") in names):
                return []
            arguments = item.get("arguments", item.get("parameters", {}))
            if not isinstance(arguments, dict):
                return []
            calls.append({
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": item["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
            })
    return calls
