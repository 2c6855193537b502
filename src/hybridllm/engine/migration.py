"""Phase migration: prefill on the device, then decode on the host (``--decode-on host``).

Prefill is compute-bound and wants the device; decode at long context is bound by reading the
KV, and host RAM holds far more of it than VRAM. After the prompt is processed, every layer's KV
moves once into a host-tier cache and decoding continues there on a host copy of the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridllm.kvcache.base import KVCache, MemoryLedger
from hybridllm.kvcache.dynamic import DynamicCache
from hybridllm.runtime.runner import ModelRunner


@dataclass
class PhaseMigration:
    """Moves a request's KV to the host after prefill and names the runner that decodes there.

    Args:
        decode_model: the runner of the model copy with every weight on the host.
        new_host_cache: builds an empty host-tier cache accounted in a given ledger.
    """

    decode_model: ModelRunner
    new_host_cache: Callable[[MemoryLedger], DynamicCache]

    def migrate(self, cache: KVCache, reserve_tokens: int = 0) -> DynamicCache:
        """A host cache holding everything ``cache`` held; ``cache`` is emptied (its memory freed).

        ``reserve_tokens``: the request's prompt plus its token budget (allocated once).
        Only the tokens that were in the device tier count as moved bytes (the new cache's
        ``bus_bytes["d2h"]``).
        """
        target = self.new_host_cache(cache.ledger)
        target.reserve(reserve_tokens)
        for layer_idx in range(cache.spec.n_layers):
            keys, values = cache.read_layer(layer_idx)  # (B, Hkv, length, D)
            device_tokens = cache.length(layer_idx) - cache.host_tokens(layer_idx)
            target.extend(layer_idx, keys.to(target.storage_device), values.to(target.storage_device),
                          moved_bytes=2 * device_tokens * token_row_bytes(keys))
        cache.reset()
        return target


def token_row_bytes(keys: torch.Tensor) -> int:
    """Bytes of one token's keys in a (B, Hkv, T, D) tensor."""
    batch, n_kv_heads, _, head_dim = keys.shape
    return batch * n_kv_heads * head_dim * keys.element_size()
