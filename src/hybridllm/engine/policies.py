"""The per-sequence policies the request loop calls: where a sequence's KV lives and what it reuses.

- a new sequence's cache (the KV policy's, allocated up front unless it spills page by page);
- relieve (``--kv-adaptive``): after each forward, when a memory tier is over its threshold,
  halve a tiered hot window, quantize cold pages or move the sequence to the host runner
  (:class:`~hybridllm.engine.adaptive.AdaptivePolicy`); a step that cannot fit at all moves it
  to the host before it runs again;
- migrate (``--decode-on host``): when its prompt is done, its KV to host RAM and its decode
  to the host runner;
- fork: the other ``n - 1`` sequences of a request, each on its own copy of the prompt's KV;
- prefix reuse: the prefix cache's pages of a prompt restored right before its first chunk, and
  a finished sequence's whole pages offered back.

Nothing here emits events or samples; the scheduler asks before planning, the executor around
forwards, the output processor when a prompt is done or a sequence finishes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hybridllm.engine.adaptive import AdaptivePolicy
from hybridllm.engine.admission import grows_page_by_page
from hybridllm.engine.sequence import SequenceState
from hybridllm.kvcache.base import KVCache, MemoryLedger
from hybridllm.kvcache.copy import copy_cache
from hybridllm.kvcache.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)


class LoopPolicies:
    """The policies of one request loop.

    Args:
        runtime: the built model (runners, caches, migration).
        ledger: the loop's KV ledger (every sequence's cache counts in it).
        adaptive: the adaptive policy (None: ``--no-kv-adaptive``).
        prefix_cache: KV pages reused across requests (None: none).
    """

    def __init__(self, runtime: Any, ledger: MemoryLedger, adaptive: AdaptivePolicy | None,
                 prefix_cache: PrefixCache | None) -> None:
        self.runtime = runtime
        self.ledger = ledger
        self.adaptive = adaptive
        self.prefix_cache = prefix_cache
        self.prefill_chunk = runtime.engine_config.prefill_chunk
        self.freed_bus_bytes = {"h2d": 0, "d2h": 0}  # bus bytes of the caches already freed

    def bus_bytes(self, running: list[SequenceState]) -> dict[str, int]:
        """Bytes moved between host and device, per direction: by the freed caches and ``running``'s."""
        bus = dict(self.freed_bus_bytes)
        for cache in (cache for seq in running for cache in seq.caches):
            for direction, n in cache.bus_bytes.items():
                bus[direction] = bus.get(direction, 0) + n
        return bus

    def free(self, seq: SequenceState) -> None:
        """Free every cache the sequence used (its bus bytes kept in the totals)."""
        caches, seq.cache, seq.caches = seq.caches, None, []
        for cache in caches:
            for direction, n in cache.bus_bytes.items():
                self.freed_bus_bytes[direction] = self.freed_bus_bytes.get(direction, 0) + n
            try:
                cache.reset()
            except Exception:
                logger.exception("could not free a KV cache")

    # ---- where the KV lives ------------------------------------------------------------------
    def new_cache(self, seq: SequenceState, on_host: bool) -> KVCache:
        """An empty cache for ``seq`` in the shared ledger (the KV policy's, or a host cache),
        allocated up front for its prompt and budget, except a tiered cache under a device budget:
        its hot store grows page by page, so running sequences share the device and spill their
        cold pages to the host."""
        cache = self.runtime.new_host_cache(self.ledger) if on_host else self.runtime.new_cache(self.ledger)
        if on_host or not grows_page_by_page(self.runtime.kv_config.kv_cache, self.ledger):
            cache.reserve(seq.reserve_tokens)
        return cache

    def relieve(self, seq: SequenceState) -> None:
        """Adaptive re-planning after a forward: when a tier is over its threshold (its actions go
        to ``seq.actions``)."""
        if self.adaptive is not None:
            seq.adopt(*self.adaptive.relieve(seq.cache, seq.runner, seq.reserve_tokens, seq.actions))

    def move_to_host(self, seq: SequenceState, why: str) -> bool:
        """Continue ``seq`` on the host runner with its KV in host RAM; False (nothing done)
        without the adaptive policy."""
        if self.adaptive is None:
            return False
        seq.adopt(*self.adaptive.move_to_host(seq.cache, seq.reserve_tokens, seq.actions, why))
        return True

    def migrate(self, seq: SequenceState) -> None:
        """Move a prefilled sequence's KV to the host, where it decodes (``--decode-on host``)."""
        migration = self.runtime.migration()
        seq.adopt(migration.migrate(seq.cache, seq.reserve_tokens), migration.runner)

    def fork(self, seq: SequenceState) -> list[SequenceState]:
        """The other ``n - 1`` sequences of a prefilled request, each on its own copy of the
        prompt's KV and its runner; the request's reservation (n sequences' worth) is split evenly."""
        n = seq.params.n
        if n == 1:
            return []
        seq.kv_bytes //= n
        forks = []
        with torch.inference_mode():
            for index in range(1, n):
                fork = seq.fork(index)
                cache = self.new_cache(fork, on_host=seq.runner is not self.runtime.runner)
                fork.adopt(copy_cache(seq.cache, cache), seq.runner)
                forks.append(fork)
        return forks

    # ---- the prefix cache --------------------------------------------------------------------
    def prefix_stats(self) -> dict | None:
        """The prefix cache's counters (prompt tokens looked up, supplied) and bytes per tier."""
        cache = self.prefix_cache
        if cache is None:
            return None
        return {"queries": cache.stats.queries, "hits": cache.stats.hits, "bytes": cache.bytes_per_tier()}

    def first_page(self, seq: SequenceState) -> bytes | None:
        """The prefix cache's address of a prompt's first page, when the prompt could reuse it
        (a prefix cache, not looked up yet, a whole page before its last token)."""
        cache = self.prefix_cache
        if cache is None or seq.prefix_looked_up or len(seq.prompt_ids) <= cache.page_tokens:
            return None
        return cache.addresses(seq.prompt_ids[:cache.page_tokens])[0]

    def reuse_prefix(self, seq: SequenceState) -> None:
        """Before a sequence's first prefill chunk, copy the cached pages of its prompt's prefix
        into its cache. Asked then rather than at admission, so that requests admitted together
        reuse the pages of those among them whose prompts were prefilled first (a burst of
        requests sharing a system prompt prefills it once)."""
        if seq.prefix_looked_up:
            return
        seq.prefix_looked_up = True
        if (self.prefix_cache is None or seq.prefilled or seq.params.prompt_logprobs is not None  # every row's logits
                or seq.runner.rotates_long(len(seq.prompt_ids))):  # stored pages rotate with the short set
            return
        # at least the last prompt token is prefilled: its logits choose the first token
        with torch.inference_mode():
            seq.cached_tokens = self.prefix_cache.restore(seq.prompt_ids, seq.cache, len(seq.prompt_ids) - 1,
                                                          self.prefill_chunk)
        seq.prefilled = seq.cached_tokens

    def keep_pages(self, seq: SequenceState, token_ids: list[int]) -> None:
        """Offer the whole pages of ``token_ids`` held in the sequence's cache to the prefix cache."""
        if self.prefix_cache is None or seq.cache is None or seq.index:  # forks repeat their parent's prompt
            return
        if seq.runner.rotates_long(seq.cache.seq_length):  # longrope keys past the switch: not for shorter prompts
            return
        try:
            with torch.inference_mode():
                self.prefix_cache.store(token_ids, seq.cache)
        except Exception:  # reuse is an optimisation: the request itself must not fail for it
            logger.exception("%s: could not keep KV pages in the prefix cache", seq.request_id)
