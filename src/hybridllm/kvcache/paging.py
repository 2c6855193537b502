"""Page-table bookkeeping of the tiered cache, in plain Python ints (no tensors).

One :class:`PageTable` per layer says where each token position lives:

    positions  0 .. sink-1                       attention sinks: hot (device) forever
               sink .. sink + cold*page - 1      cold pages: host
               sink + cold*page .. length-1      hot pages, the newest possibly partial: device

The hot store holds the sink tokens followed by the hot tokens, in position order; the cold
store holds the cold pages in order. Pages only ever leave the hot tier from its oldest end
(just after the sinks), so both stores stay contiguous. The policy functions below turn a
window, a host fraction or a device budget into a number of pages to move.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridllm.kvcache.base import KVBudgetError


@dataclass(frozen=True)
class TruncatePlan:
    """How the stores of one layer follow a truncation.

    Attributes:
        hot_keep: tokens of the hot store to keep (before ``restore`` is appended to it).
        cold_keep: tokens of the cold store to keep (whole pages).
        restore: range (start, end) of cold-store tokens that come back to the hot store
            because the cut fell inside their page (a partial page is always hot); empty if equal.
    """

    hot_keep: int
    cold_keep: int
    restore: tuple[int, int] = (0, 0)

    @property
    def restored_tokens(self) -> int:
        return self.restore[1] - self.restore[0]


@dataclass
class PageTable:
    """Where one layer's tokens live (see the module docstring). Plain ints.

    Args:
        page_size: tokens per page.
        sink_tokens: leading tokens that never leave the device.
    """

    page_size: int
    sink_tokens: int = 0
    length: int = 0
    cold_pages: int = 0

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.sink_tokens < 0:
            raise ValueError(f"page_size must be >= 1 and sink_tokens >= 0, got {self.page_size}, {self.sink_tokens}")

    @property
    def cold_tokens(self) -> int:
        return self.cold_pages * self.page_size

    @property
    def hot_tokens(self) -> int:
        """Tokens in the hot store (sinks included)."""
        return self.length - self.cold_tokens

    @property
    def sinks_held(self) -> int:
        return min(self.sink_tokens, self.length)

    def movable_pages(self) -> int:
        """Complete hot pages after the sinks: the ones that may move to the cold tier now."""
        return max(0, self.length - self.sink_tokens - self.cold_tokens) // self.page_size

    def hot_index(self, position: int) -> int:
        """Index of a hot ``position`` in the hot store."""
        if position < self.sink_tokens:
            return position
        if position < self.sink_tokens + self.cold_tokens:
            raise ValueError(f"position {position} is cold")
        return position - self.cold_tokens

    def append(self, n_tokens: int) -> None:
        self.length += n_tokens

    def evict(self, n_pages: int) -> tuple[int, int]:
        """Mark the ``n_pages`` oldest hot pages cold; returns their (start, n_tokens) in the hot store."""
        if not 0 <= n_pages <= self.movable_pages():
            raise ValueError(f"cannot evict {n_pages} pages; {self.movable_pages()} are movable")
        start = self.sink_tokens  # pages exist only once every sink slot is filled
        self.cold_pages += n_pages
        return start, n_pages * self.page_size

    def truncate(self, length: int) -> TruncatePlan:
        """Keep positions ``0 .. length-1``; returns how the stores follow."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate {self.length} tokens to {length}")
        self.length = length
        cold_end = self.sink_tokens + self.cold_tokens
        if length >= cold_end:  # the cut is in the hot part (or there is no cold part)
            return TruncatePlan(hot_keep=length - self.cold_tokens, cold_keep=self.cold_tokens)
        if length <= self.sink_tokens:  # only sinks remain
            self.cold_pages = 0
            return TruncatePlan(hot_keep=length, cold_keep=0)
        kept_pages, partial = divmod(length - self.sink_tokens, self.page_size)
        self.cold_pages = kept_pages
        start = kept_pages * self.page_size
        return TruncatePlan(hot_keep=self.sink_tokens, cold_keep=start, restore=(start, start + partial))


def window_cold_pages(length: int, window: int, sink_tokens: int, page_size: int) -> int:
    """Cold pages the sliding window asks for: the pages wholly older than the newest ``window`` tokens."""
    return max(0, length - window - sink_tokens) // page_size


def fraction_cold_pages(length: int, percent: float, sink_tokens: int, page_size: int) -> int:
    """Cold pages holding (at most) ``percent`` % of ``length`` tokens; sinks never count as cold."""
    wanted = int(length * percent / 100 + 1e-9) // page_size
    return min(wanted, max(0, length - sink_tokens) // page_size)


def pages_to_evict(table: PageTable, new_tokens: int, target_cold_pages: int, max_hot_tokens: int | None) -> int:
    """Pages to move hot -> cold before ``new_tokens`` are appended to ``table``'s layer.

    Moves what the policy wants (``target_cold_pages``, for the length after the append) and
    then, if the hot store would hold more than ``max_hot_tokens`` (the device budget; None:
    unlimited), more of the oldest hot pages. Only complete pages move, so the new tokens are
    hot while they attend (and cold keys all precede them).

    Raises:
        KVBudgetError: when even moving every complete page leaves too much on the device.
    """
    movable = table.movable_pages()
    n_pages = min(max(0, target_cold_pages - table.cold_pages), movable)
    if max_hot_tokens is not None:
        excess = table.hot_tokens - n_pages * table.page_size + new_tokens - max_hot_tokens
        if excess > 0:
            n_pages += -(-excess // table.page_size)
            if n_pages > movable:
                must_stay = table.hot_tokens - movable * table.page_size + new_tokens
                raise KVBudgetError(
                    f"the device KV budget holds {max_hot_tokens} more tokens for this layer, but {must_stay} "
                    f"must stay on the device (sink tokens, the newest partial page and {new_tokens} new tokens); "
                    f"raise --vram-budget, or lower the prefill chunk, the page size or --kv-sink-tokens"
                )
    return n_pages


def pages_to_settle(table: PageTable, target_cold_pages: int) -> int:
    """Pages to move hot -> cold after an append so the layer meets its policy again."""
    return min(max(0, target_cold_pages - table.cold_pages), table.movable_pages())
