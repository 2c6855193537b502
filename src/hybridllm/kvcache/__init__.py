"""KV cache strategies. Each owns attention over what it stores (see ``base.KVCache``)."""

from hybridllm.kvcache.base import KVCache, KVSpec, MemoryLedger
from hybridllm.kvcache.dynamic import DynamicCache

__all__ = ["KVCache", "KVSpec", "MemoryLedger", "DynamicCache"]
