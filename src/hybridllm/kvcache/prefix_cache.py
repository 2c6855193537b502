"""KV reuse across requests: content-addressed pages kept in host RAM, then on disk.

A sequence's whole pages are addressed by :func:`~hybridllm.kvcache.prefix_hash.page_hashes`.
When a request starts, the longest run of its prompt's pages found here is copied into its new
cache (:meth:`PrefixCache.restore`), and only the rest of the prompt is prefilled; when its prompt
is done, and when it finishes, its pages not yet here are stored (:meth:`PrefixCache.store`).

Tiers: host RAM under ``ram_budget`` bytes, least recently used first out, and the disk tier
(when there is one), written through as pages arrive so that they survive a restart or a crash; a
page pushed out of RAM stays on disk (until the disk budget pushes it out too), and a page found
only on disk is read back into RAM. Pages are copied into a sequence's own cache (copy-in), so running
sequences never share storage with the prefix cache: a page being copied is referenced by the
copy, and evicting it from the index never frees it under the copy.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridllm.kvcache.base import KVCache
from hybridllm.kvcache.prefix_disk import DiskTier
from hybridllm.kvcache.prefix_hash import PAGE_TOKENS, page_hashes
from hybridllm.kvcache.prefix_page import KVPage

logger = logging.getLogger(__name__)

DEFAULT_DISK_BUDGET = 8 << 30  # bytes of page files when a disk directory is given without a size


@dataclass
class PrefixStats:
    """Counters in tokens, as vLLM counts them: prompt tokens looked up, and those found."""

    queries: int = 0
    hits: int = 0


class PrefixCache:
    """Reusable KV pages of one model and KV format.

    Args:
        root: the chain root (:func:`~hybridllm.kvcache.prefix_hash.salt` of the model and KV format).
        ram_budget: bytes of pages held in host RAM.
        disk_dir: the disk tier's directory (None: no disk tier).
        disk_budget: bytes of page files on disk.
        page_tokens: tokens per page.
    """

    def __init__(self, root: bytes, ram_budget: int, disk_dir: str | Path | None = None,
                 disk_budget: int = DEFAULT_DISK_BUDGET, page_tokens: int = PAGE_TOKENS) -> None:
        if ram_budget < 0 or disk_budget < 0:
            raise ValueError("prefix cache budgets must be >= 0")
        self.root = root
        self.ram_budget = ram_budget
        self.page_tokens = page_tokens
        self.disk = DiskTier(disk_dir, disk_budget, root) if disk_dir is not None else None
        self.stats = PrefixStats()
        self._ram: collections.OrderedDict[bytes, KVPage] = collections.OrderedDict()  # LRU first
        self._ram_bytes = 0
        self._lock = threading.Lock()  # the request loop writes; metrics read from other threads

    # ---- what it holds -------------------------------------------------------------------
    def bytes_per_tier(self) -> dict[str, int]:
        """Bytes of pages held per tier ("host": RAM, "disk": page files)."""
        with self._lock:
            disk = self.disk.nbytes if self.disk is not None and self.disk.enabled else 0
            return {"host": self._ram_bytes, "disk": disk}

    def addresses(self, token_ids: Sequence[int]) -> list[bytes]:
        """The page addresses of ``token_ids`` (whole pages only)."""
        return page_hashes(token_ids, self.root, self.page_tokens)

    def lookup(self, addresses: Sequence[bytes]) -> list[KVPage]:
        """The pages of the longest run of ``addresses`` held in any tier, from the first one."""
        pages = []
        with self._lock:
            for address in addresses:
                page = self._ram.get(address)
                if page is not None:
                    self._ram.move_to_end(address)
                elif self.disk is not None and self.disk.enabled and (page := self.disk.get(address)) is not None:
                    self._keep_in_ram(address, page)
                else:
                    break
                pages.append(page)
        return pages

    def insert(self, address: bytes, page: KVPage) -> None:
        """Hold ``page`` at ``address`` (most recently used)."""
        with self._lock:
            if address in self._ram:
                self._ram.move_to_end(address)
                return
            self._keep_in_ram(address, page)

    def __contains__(self, address: bytes) -> bool:
        with self._lock:
            return address in self._ram or (self.disk is not None and address in self.disk)

    # ---- with a sequence's cache ---------------------------------------------------------
    def restore(self, token_ids: Sequence[int], cache: KVCache, max_tokens: int, chunk_tokens: int) -> int:
        """Copy the cached pages of ``token_ids[:max_tokens]`` into the empty ``cache``; returns the tokens copied.

        Args:
            token_ids: the prompt.
            cache: the sequence's new cache.
            max_tokens: the most tokens to reuse (the prompt minus at least one token to prefill).
            chunk_tokens: the most tokens appended in one call (a tiered cache evicts between calls).
        """
        self.stats.queries += len(token_ids)
        if not cache.extendable or cache.seq_length:
            return 0
        pages = self.lookup(self.addresses(token_ids[:max_tokens]))
        if not pages:
            return 0
        per_call = max(1, chunk_tokens // self.page_tokens)
        for first in range(0, len(pages), per_call):
            group = pages[first:first + per_call]
            keys = torch.cat([page.keys for page in group], dim=3)  # (n_layers, B, Hkv, tokens, D)
            values = torch.cat([page.values for page in group], dim=3)
            for layer_idx in range(cache.spec.n_layers):
                cache.extend(layer_idx, keys[layer_idx], values[layer_idx])
        restored = len(pages) * self.page_tokens
        self.stats.hits += restored
        return restored

    def store(self, token_ids: Sequence[int], cache: KVCache) -> int:
        """Hold the whole pages of ``token_ids`` (the first ``cache.seq_length`` of them are in
        ``cache``) that are not held yet; returns the pages added."""
        n_tokens = min(len(token_ids), cache.seq_length)
        addresses = self.addresses(token_ids[:n_tokens])
        missing = [i for i, address in enumerate(addresses) if address not in self]
        if not missing or self.ram_budget == 0 and self.disk is None:
            return 0
        layers = [cache.read_layer(i) for i in range(cache.spec.n_layers)]  # (B, Hkv, length, D) each
        for i in missing:
            start, end = i * self.page_tokens, (i + 1) * self.page_tokens
            page = KVPage(torch.stack([k[:, :, start:end] for k, _ in layers]).cpu(),  # (n_layers, B, Hkv, P, D)
                          torch.stack([v[:, :, start:end] for _, v in layers]).cpu())
            self.insert(addresses[i], page)
        return len(missing)

    # ---- tiers ---------------------------------------------------------------------------
    def _keep_in_ram(self, address: bytes, page: KVPage) -> None:
        """Hold a page in RAM and write it through to the disk tier (so it survives a restart);
        least recently used pages leave RAM to fit (they stay on disk, where there is one)."""
        if self.disk is not None and self.disk.enabled:
            self.disk.put(address, page)
        if page.nbytes > self.ram_budget:
            return
        self._ram[address] = page
        self._ram_bytes += page.nbytes
        while self._ram_bytes > self.ram_budget:
            _, old = self._ram.popitem(last=False)
            self._ram_bytes -= old.nbytes
