"""KV cache strategies. Each owns attention over what it stores (see ``base.KVCache``)."""

from hybridllm.kvcache.base import KVBudgetError, KVCache, KVSpec, MemoryLedger
from hybridllm.kvcache.dynamic import DynamicCache
from hybridllm.kvcache.factory import create_cache
from hybridllm.kvcache.host import HostCache
from hybridllm.kvcache.offloaded import OffloadedCache
from hybridllm.kvcache.quantized import QuantizedCache
from hybridllm.kvcache.tiered import TieredCache

__all__ = [
    "KVCache", "KVSpec", "MemoryLedger", "KVBudgetError", "create_cache",
    "DynamicCache", "OffloadedCache", "QuantizedCache", "TieredCache", "HostCache",
]
