"""Copy one cache's tokens into another: the n sequences of one request share its prompt's KV.

The prompt is prefilled once; each further sequence continues on a copy made here.
"""

from __future__ import annotations

import torch

from hybridllm.kvcache.base import KVCache
from hybridllm.kvcache.dynamic import DynamicCache


def copy_cache(source: KVCache, target: KVCache) -> KVCache:
    """Append every token of ``source`` to the empty ``target`` (any strategies); returns ``target``.

    A dense target takes the keys and values as they are; any other strategy stores them the way
    it stores new tokens (through :meth:`~KVCache.attend`, with queries whose output is dropped),
    so its own layout (pages, tiers, quantization) applies.
    """
    if target.seq_length:
        raise ValueError(f"copy_cache needs an empty target, this one holds {target.seq_length} tokens")
    for layer_idx in range(source.spec.n_layers):
        keys, values = source.read_layer(layer_idx)  # (B, Hkv, length, D) each
        if isinstance(target, DynamicCache):
            target.extend(layer_idx, keys.to(target.storage_device), values.to(target.storage_device))
        else:
            keys, values = keys.to(target.spec.device), values.to(target.spec.device)
            target.attend(layer_idx, torch.zeros_like(keys), keys, values)  # q: (B, Hkv, length, D)
    return target
