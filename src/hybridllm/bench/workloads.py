"""Named chat prompts for the speculative-decoding bench (``bench --preset spec``, ``--workload``).

- ``rewrite``: a ~600-token Python file (``spec_inputs/inventory.py.txt``) to give back with one
  identifier renamed: the answer repeats its input, where proposals from the prompt pay most;
- ``quote``: a ~550-token document (``spec_inputs/library_rules.txt``) and a request to repeat the
  passage that answers a question: the answer quotes its input;
- ``chat``: a free-form request whose answer repeats nothing: proposals rarely match, so it shows
  what speculation costs when it does not pay (at most 128 new tokens, a chat turn's length: the
  default 135M model's stories turn repetitive a few hundred tokens in, and then proposals match).

A workload's prompt is the model's chat template around the message, tokenized by our tokenizer of
the model; every engine gets the same ids. Generation is greedy and stops at the end of sequence
(or at the bench's ``--new-tokens``), as a user's request would.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import Any

from hybridllm.errors import ConfigError

INPUTS = "spec_inputs"


def _input(name: str) -> str:
    return resources.files("hybridllm.bench").joinpath(INPUTS, name).read_text(encoding="utf-8")


def _rewrite() -> str:
    source = _input("inventory.py.txt")
    return (f"Here is a Python file:\n\n```python\n{source}```\n\n"
            "Rewrite the file with the class Inventory renamed to Stockroom. Reply with the whole file in a code block.")


def _quote() -> str:
    return f"{_input('library_rules.txt')}\n\nRepeat the paragraph about late returns from the rules above."


def _chat() -> str:
    return "Write a short story about a lighthouse keeper who finds a message in a bottle."


WORKLOADS: dict[str, Callable[[], str]] = {"rewrite": _rewrite, "quote": _quote, "chat": _chat}
MAX_NEW_TOKENS = {"rewrite": 768, "quote": 768, "chat": 128}  # each workload's answer at most (the bench's cap)


def check_workload(name: str) -> None:
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def workload_message(name: str) -> str:
    """The user message of workload ``name``."""
    check_workload(name)
    return WORKLOADS[name]()


def workload_prompt_ids(name: str, tokenizer: Any) -> list[int]:
    """The token ids of workload ``name`` for a model's tokenizer: its chat template around the
    message (a model without one gets the message as it is)."""
    message = workload_message(name)
    if tokenizer.has_chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(message, add_special_tokens=True)
