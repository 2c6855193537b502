"""Which engine replica a request goes to: the one most likely to hold its prompt's KV prefix.

Requests that start alike share their first KV pages, so sending them to the same replica lets
its prefix cache serve them. The routing key is the address of the prompt's first prefix-cache
page (:class:`PageKey`: the model's tokenizer and chat template turn the request into the token
ids the replica will see, hashed as :func:`~hybridllm.kvcache.prefix_hash.page_hashes` does).
Without a tokenizer, or when the template refuses the request (the replica will answer the
error), :func:`prefix_key` stands in: the first :data:`PREFIX_CHARS` characters of the prompt (a
chat's messages as ``role`` + ``content`` in order), or a token-id prompt's first
:data:`PREFIX_TOKENS` ids.

Replicas sit on a consistent-hash ring (:class:`HashRing`): a key's replica is the first live
one clockwise from the key, so a replica that dies moves only its own keys. :func:`choose_replica`
takes that replica unless it is much busier (in-flight requests) than the least loaded one.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridllm.errors import HybridLLMError
from hybridllm.kvcache.prefix_hash import PAGE_TOKENS, page_hashes, salt

PREFIX_CHARS = 128  # about 32 tokens of English text (some 4 characters a token)
PREFIX_TOKENS = 32
VIRTUAL_NODES = 64  # points per replica on the ring: keys spread evenly over few replicas
DEFAULT_MAX_IMBALANCE = 4  # in-flight requests the preferred replica may exceed the least loaded by


def stable_hash(data: bytes) -> int:
    """A 64-bit hash that is the same in every process (unlike ``hash`` of a str)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _message_text(message: Any) -> str:
    if not isinstance(message, Mapping):
        return json.dumps(message, sort_keys=True, default=str)
    content = message.get("content")
    if not isinstance(content, str):  # content parts, tool calls: their JSON
        content = json.dumps(content, sort_keys=True, default=str)
    return f"{message.get('role', '')}\x1f{content}\x1e"


def prefix_key(body: Any) -> int | None:
    """The routing key of a chat or completion request body: a hash of its prompt's first page.

    Args:
        body: the request's JSON (``messages`` for chat, ``prompt`` for completions).

    Returns:
        The key, or None when the body holds no prompt (the request goes to the least loaded).
    """
    if not isinstance(body, Mapping):
        return None
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        return stable_hash("".join(_message_text(m) for m in messages)[:PREFIX_CHARS].encode())
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        return stable_hash(prompt[:PREFIX_CHARS].encode())
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:PREFIX_TOKENS]):
        return stable_hash(b"ids:" + ",".join(map(str, prompt[:PREFIX_TOKENS])).encode())
    return None


class PageKey:
    """The routing key from the prefix cache's page addresses: a hash of the request's first page
    of token ids, as the replica will tokenize it (falls back to :func:`prefix_key`).

    Args:
        tokenizer: the served model's tokenizer (``encode``, ``apply_chat_template``).
    """

    ROOT = salt("hybridllm routing")  # routing only needs the same key for the same first page

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids as the replica sees them, or None (no prompt)."""
        messages = body.get("messages")
        if isinstance(messages, list) and messages:
            text = self.tokenizer.apply_chat_template(messages, extra_context={"tools": body.get("tools")}
                                                      if body.get("tools") else None)
            return self.tokenizer.encode(text, add_special_tokens=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, str) and prompt:
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        return None

    def __call__(self, body: Any) -> int | None:
        if not isinstance(body, Mapping):
            return None
        try:
            ids = self.token_ids(body)
        except (HybridLLMError, TypeError, ValueError):
            return prefix_key(body)
        if ids is None:
            return None
        first = page_hashes(ids[:PAGE_TOKENS], self.ROOT)
        return stable_hash(first[0] if first else b"short:" + ",".join(map(str, ids)).encode())


class HashRing:
    """Consistent hashing of keys onto replica ids (:data:`VIRTUAL_NODES` points per replica).

    Args:
        replicas: every replica id, live or not (the ring never changes; dead ones are skipped).
        virtual_nodes: points per replica.
    """

    def __init__(self, replicas: Sequence[str], virtual_nodes: int = VIRTUAL_NODES) -> None:
        points = sorted((stable_hash(f"{replica}#{i}".encode()), replica)
                        for replica in replicas for i in range(virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._owners = [replica for _, replica in points]

    def preferred(self, key: int, live: Collection[str]) -> str | None:
        """The first live replica clockwise from ``key`` (None: no replica is live)."""
        start = bisect.bisect(self._hashes, key)
        n = len(self._owners)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if owner in live:
                return owner
        return None


@dataclass(frozen=True)
class Route:
    """Where a request goes and why: ``reason`` is ``prefix`` (its key's replica) or
    ``least_loaded`` (no key, or the key's replica was much busier)."""

    replica: str
    reason: str


def choose_replica(key: int | None, ring: HashRing, live: Sequence[str], in_flight: Mapping[str, int],
                   max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> Route | None:
    """The replica for a request with routing ``key``.

    Args:
        key: :func:`prefix_key` of the request (None: no prompt to route by).
        ring: the replicas' ring.
        live: the replicas that answer now, in a fixed order (ties of load go to the first).
        in_flight: requests each replica is answering now.
        max_imbalance: the key's replica is skipped for the least loaded one when it has at least
            this many more requests in flight.

    Returns:
        The route, or None when no replica is live.
    """
    if not live:
        return None
    least = min(live, key=lambda replica: in_flight.get(replica, 0))
    preferred = ring.preferred(key, live) if key is not None else None
    if preferred is None:
        return Route(least, "least_loaded")
    if in_flight.get(preferred, 0) - in_flight.get(least, 0) >= max_imbalance:
        return Route(least, "least_loaded")
    return Route(preferred, "prefix")
