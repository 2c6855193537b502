"""The prefix cache of a built runtime: its chain root (model identity + KV format) and tiers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridllm.config import PrefixCacheConfig
from hybridllm.kvcache.prefix_cache import DEFAULT_DISK_BUDGET, PrefixCache
from hybridllm.kvcache.prefix_hash import PAGE_TOKENS, salt
from hybridllm.loading.random_checkpoint import RandomCheckpoint


def model_identity(checkpoint: Any) -> str:
    """What tells this model's weights apart: the file (path, size, modification time) or, for
    random weights, the seed; plus the architecture numbers."""
    path = Path(checkpoint.path)
    parts = [checkpoint.file_format, str(path.resolve()), repr(checkpoint.config)]
    if isinstance(checkpoint, RandomCheckpoint):
        parts.append(f"seed={checkpoint.seed},dtype={checkpoint.dtype}")
    elif path.exists():
        files = sorted(path.iterdir()) if path.is_dir() else [path]
        parts += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files if f.is_file()]
    return "|".join(parts)


def kv_format(runtime: Any) -> str:
    """What makes two caches' stored numbers the same: weights and activations as run, compute
    dtype, KV strategy and its number formats."""
    kv = runtime.kv_config
    return (f"weights={runtime.weights_format},activations={runtime.activations},"
            f"dtype={runtime.engine_config.dtype},kv={kv.kv_cache},"
            f"bits={kv.kv_bits},cold_bits={kv.kv_cold_bits},group={kv.kv_group_size},"
            f"key_quant={kv.kv_key_quant},kv_dtype={kv.kv_dtype}")


def build_prefix_cache(runtime: Any, config: PrefixCacheConfig) -> PrefixCache | None:
    """The runtime's prefix cache under ``config`` (None when it is off)."""
    if not config.enabled:
        return None
    root = salt(model_identity(runtime.checkpoint), kv_format(runtime))
    spec = runtime.kv_spec()
    page_shape = (spec.n_layers, spec.batch_size, spec.n_kv_heads, PAGE_TOKENS, spec.head_dim)  # a KVPage's keys
    return PrefixCache(root, ram_budget=config.ram, disk_dir=config.disk_dir,
                       disk_budget=config.disk_bytes if config.disk_bytes is not None else DEFAULT_DISK_BUDGET,
                       device_budget=config.vram, device=runtime.engine_config.torch_device,
                       page_shape=page_shape, page_dtype=spec.dtype)
