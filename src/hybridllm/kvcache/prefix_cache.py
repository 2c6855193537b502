"""KV reuse across requests: content-addressed pages kept in host RAM, then on disk.

A sequence's whole pages are addressed by :func:`~hybridllm.kvcache.prefix_hash.page_hashes`.
When a request starts, the longest run of its prompt's pages found here is copied into its new
cache (:meth:`PrefixCache.restore`), and only the rest of the prompt is prefilled; when its prompt
is done, and when it finishes, its pages not yet here are stored (:meth:`PrefixCache.store`).

Tiers, hottest first: the compute device (``device_budget`` bytes, 0 by default), host RAM
(``ram_budget``), and the disk tier (when there is one), written through as pages arrive so that
they survive a restart or a crash. Each memory tier pushes out its least recently used pages: out
of the device they move to RAM, out of RAM they are dropped (their copy on disk stays until the
disk budget pushes it out too). A page found in a lower tier moves up to the hottest one. Pages are copied into a sequence's own cache (copy-in), so running
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


class MemoryTier:
    """Pages in one memory (the compute device, or host RAM) under a byte budget, least recently
    used first out.

    Args:
        device: where its pages live.
        budget: bytes of pages it may hold (0: none).
    """

    def __init__(self, device: torch.device, budget: int) -> None:
        self.device = device
        self.budget = budget
        self.pages: collections.OrderedDict[bytes, KVPage] = collections.OrderedDict()  # LRU first
        self.nbytes = 0

    def get(self, address: bytes) -> KVPage | None:
        page = self.pages.get(address)
        if page is not None:
            self.pages.move_to_end(address)
        return page

    def put(self, address: bytes, page: KVPage) -> list[tuple[bytes, KVPage]]:
        """Hold ``page`` (moved here); returns the pages pushed out to fit (oldest first), or
        ``page`` itself when it is larger than the whole budget."""
        if page.nbytes > self.budget:
            return [(address, page)]
        if address in self.pages:
            self.pages.move_to_end(address)
            return []
        self.pages[address] = page.to(self.device)
        self.nbytes += page.nbytes
        pushed = []
        while self.nbytes > self.budget:
            old_address, old = self.pages.popitem(last=False)
            self.nbytes -= old.nbytes
            pushed.append((old_address, old))
        return pushed


class PrefixCache:
    """Reusable KV pages of one model and KV format.

    Args:
        root: the chain root (:func:`~hybridllm.kvcache.prefix_hash.salt` of the model and KV format).
        ram_budget: bytes of pages held in host RAM.
        disk_dir: the disk tier's directory (None: no disk tier).
        disk_budget: bytes of page files on disk.
        page_tokens: tokens per page.
        device_budget: bytes of pages held on the compute device (the hot tier; 0: none).
        device: the compute device.
        page_shape: the (n_layers, B, Hkv, P, D) of a page of this model (None: pages read from
            disk are not checked against it).
        page_dtype: the dtype pages are held in (None: not checked).
    """

    def __init__(self, root: bytes, ram_budget: int, disk_dir: str | Path | None = None,
                 disk_budget: int = DEFAULT_DISK_BUDGET, page_tokens: int = PAGE_TOKENS,
                 device_budget: int = 0, device: torch.device | str = "cpu",
                 page_shape: tuple[int, ...] | None = None, page_dtype: torch.dtype | None = None) -> None:
        if min(ram_budget, disk_budget, device_budget) < 0:
            raise ValueError("prefix cache budgets must be >= 0")
        self.root = root
        self.ram_budget = ram_budget
        self.page_tokens = page_tokens
        self.disk = DiskTier(disk_dir, disk_budget, root, page_shape, page_dtype) if disk_dir is not None else None
        self.stats = PrefixStats()
        # the memory tiers, hottest first: a page pushed out of one moves to the next
        self._tiers = {"device": MemoryTier(torch.device(device), device_budget),
                       "host": MemoryTier(torch.device("cpu"), ram_budget)}
        self._lock = threading.Lock()  # the request loop writes; metrics read from other threads

    @property
    def holds_pages(self) -> bool:
        """Whether any tier can hold a page."""
        return self.disk is not None or any(tier.budget for tier in self._tiers.values())

    # ---- what it holds -------------------------------------------------------------------
    def bytes_per_tier(self) -> dict[str, int]:
        """Bytes of pages held per tier ("device", "host": RAM, "disk": page files)."""
        with self._lock:
            disk = self.disk.nbytes if self.disk is not None and self.disk.enabled else 0
            return {**{name: tier.nbytes for name, tier in self._tiers.items()}, "disk": disk}

    def pages_per_tier(self) -> dict[str, int]:
        """Pages held per tier ("device", "host": RAM, "disk": page files)."""
        with self._lock:
            disk = self.disk.n_pages if self.disk is not None and self.disk.enabled else 0
            return {**{name: len(tier.pages) for name, tier in self._tiers.items()}, "disk": disk}

    def budget_per_tier(self) -> dict[str, int]:
        """Bytes each tier may hold ("disk": 0 without a usable disk tier)."""
        disk = self.disk.budget if self.disk is not None and self.disk.enabled else 0
        return {**{name: tier.budget for name, tier in self._tiers.items()}, "disk": disk}

    def addresses(self, token_ids: Sequence[int]) -> list[bytes]:
        """The page addresses of ``token_ids`` (whole pages only)."""
        return page_hashes(token_ids, self.root, self.page_tokens)

    def lookup(self, addresses: Sequence[bytes]) -> list[KVPage]:
        """The pages of the longest run of ``addresses`` held in any tier, from the first one; a
        page found below the hottest tier moves up to it."""
        pages = []
        with self._lock:
            for address in addresses:
                page = self._find(address)
                if page is None:
                    break
                pages.append(page)
        return pages

    def insert(self, address: bytes, page: KVPage) -> None:
        """Hold ``page`` at ``address`` (most recently used), written through to disk."""
        with self._lock:
            if self._find(address) is None:
                if self.disk is not None and self.disk.enabled:
                    self.disk.put(address, page)
                self._place(address, page)

    def __contains__(self, address: bytes) -> bool:
        with self._lock:
            return (any(address in tier.pages for tier in self._tiers.values())
                    or (self.disk is not None and address in self.disk))

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
        if not missing or not self.holds_pages:
            return 0
        layers = [cache.read_layer(i) for i in range(cache.spec.n_layers)]  # (B, Hkv, length, D) each
        for i in missing:
            start, end = i * self.page_tokens, (i + 1) * self.page_tokens
            page = KVPage(torch.stack([k[:, :, start:end] for k, _ in layers]).cpu(),  # (n_layers, B, Hkv, P, D)
                          torch.stack([v[:, :, start:end] for _, v in layers]).cpu())
            self.insert(addresses[i], page)
        return len(missing)

    # ---- tiers ---------------------------------------------------------------------------
    def _find(self, address: bytes) -> KVPage | None:
        """The page from the hottest tier holding it (moved up to the hottest tier), or None."""
        tiers = list(self._tiers.values())
        for level, tier in enumerate(tiers):
            page = tier.get(address)
            if page is not None:
                if level:
                    del tier.pages[address]
                    tier.nbytes -= page.nbytes
                    self._place(address, page)
                return page
        if self.disk is not None and self.disk.enabled and (page := self.disk.get(address)) is not None:
            self._place(address, page)
            return page
        return None

    def _place(self, address: bytes, page: KVPage) -> None:
        """Put a page in the hottest memory tier that takes it; what each tier pushes out moves
        down a tier, and out of the last one is dropped (its copy on disk, if any, stays)."""
        moving = [(address, page)]
        for tier in self._tiers.values():
            if not tier.budget:
                continue
            moving = [pushed for item in moving for pushed in tier.put(*item)]
