"""Shared by the scheduler and server tests: prompts and cached single-request references."""

from __future__ import annotations

from hybridllm import SamplingParams

# Eight different chat prompts: the first is the one checked against `hybridllm generate`.
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Tell me a joke about computers.",
    "Explain gravity to a child.",
    "What is 2+2?",
    "Name a fruit that is yellow.",
    "Who wrote Hamlet? Answer with details.",
]
MAX_TOKENS = 24

_refs: dict[tuple, object] = {}


def reference(llm, prompt, max_tokens: int = MAX_TOKENS, stop: tuple[str, ...] = ()):
    """``LLM.generate`` greedy result for ``prompt`` (a chat message text, or raw text via ("raw", text))."""
    key = (prompt, max_tokens, stop)
    if key not in _refs:
        if isinstance(prompt, tuple):
            request = prompt[1]
        else:
            request = [{"role": "user", "content": prompt}]
        _refs[key] = llm.generate(request, SamplingParams(max_tokens=max_tokens, temperature=0, stop=list(stop)))
    return _refs[key]
