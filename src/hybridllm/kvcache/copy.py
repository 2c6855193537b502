"""Fill one cache from another's tokens: the n sequences of one request share its prompt's KV.

The prompt is prefilled once; each further sequence continues on a copy made here. The target
stores the tokens the way it stores new ones (:meth:`~hybridllm.kvcache.base.KVCache.extend`),
so its own layout (pages, tiers, quantization) applies.
"""

from __future__ import annotations

from hybridllm.kvcache.base import KVCache


def copy_cache(source: KVCache, target: KVCache) -> KVCache:
    """Append every token of ``source`` to the empty ``target`` (any strategies); returns ``target``."""
    if target.seq_length:
        raise ValueError(f"copy_cache needs an empty target, this one holds {target.seq_length} tokens")
    for layer_idx in range(source.spec.n_layers):
        keys, values = source.read_layer(layer_idx)  # (B, Hkv, length, D) each
        target.extend(layer_idx, keys, values)
    return target
