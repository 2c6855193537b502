"""What a KV strategy declares about itself: tiers, memory model, costs, and how it is built.

Each strategy module (``dynamic``, ``quantized``, ...) ends with one :class:`KVStrategy` value;
:mod:`~hybridllm.kvcache.registry` lists them. Everything else (the factory, admission, the
planner, the benchmark) reads these declarations instead of branching on strategy names.

The memory model is plain arithmetic over a :class:`~hybridllm.kvcache.base.KVSpec` and the
``KVConfig`` knobs: the bytes a cache holds per tier in steady state, without the slack of page
rounding and doubling growth (a cache reserved for whole pages holds exactly that).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybridllm.config import KVConfig
from hybridllm.kvcache.base import KVCache, KVSpec, MemoryLedger
from hybridllm.kvcache.quantize import SCALE_DTYPE, channel_group, packed_size

_SCALE_BYTES = SCALE_DTYPE.itemsize


@dataclass(frozen=True)
class KVCost:
    """What the KV of one cache costs at ``n`` cached tokens (bytes; the roofline predictor's inputs).

    Attributes:
        memory: bytes held per tier.
        scratch: transient bytes per tier while attending (a dequantized copy).
        read: bytes read per tier by one decode step (every layer's attention).
        bus: bytes crossing host <-> device per decode step.
        round_trips: host <-> device synchronisations per decode step.
        prefill_bus: bytes crossing the bus while a prompt of ``n`` tokens is prefilled.
    """

    memory: dict[str, float]
    read: dict[str, float]
    scratch: dict[str, float] = field(default_factory=dict)
    bus: float = 0.0
    round_trips: int = 0
    prefill_bus: float = 0.0


@dataclass(frozen=True)
class KVStrategy:
    """One KV strategy's facts, declared once next to its cache class.

    Attributes:
        name: the ``--kv-cache`` value.
        tiers: the tiers it stores tokens in; admission bounds it by the budgets of these tiers.
        build: a fresh, empty cache from the config's knobs, a spec and a ledger.
        token_bytes: bytes one more cached token adds per tier, for the whole cache (every layer
            of the spec), once the fixed windows (residual, hot window, sinks) are full.
        cost: the cache's :class:`KVCost` at ``n`` tokens; ``query_bytes`` is what crosses the
            bus per layer when attention runs on the other tier (q there, output and LSE back).
        describe: a few words on the strategy with these knobs (the planner's explanation).
        moving_parts: how much machinery it adds (quantization, tiers, streaming); the planner
            prefers fewer on a tie.
        spills_to_host: under a bounded device budget the cache moves its own cold pages to the
            host, keeping only a hot part on the device (so a new sequence needs room for that part).
        attention_options: it applies every layer's ``KVSpec.attention`` (sliding window, scale,
            soft-cap: Gemma); the others refuse a model that has any.
        native: what the native steps read of it in place (a few words: its stores' layouts), or
            "" where they cannot: its layers then attend through PyTorch, which the runtime says
            in one warning (and ``doctor`` and the bench name).
        host_part: it attends KV held in host RAM beside the device's (split attention), through
            ``KVSpec.host_attention`` where the runtime gives one (the kernels, on a GPU).
    """

    name: str
    tiers: tuple[str, ...]
    build: Callable[[KVConfig, KVSpec, MemoryLedger], KVCache]
    token_bytes: Callable[[KVConfig, KVSpec], dict[str, float]]
    cost: Callable[[KVConfig, KVSpec, int, float], KVCost]
    describe: Callable[[KVConfig], str]
    moving_parts: int = 0
    spills_to_host: bool = False
    attention_options: bool = False
    native: str = ""
    host_part: bool = False

    def memory(self, config: KVConfig, spec: KVSpec, n_tokens: int) -> dict[str, float]:
        """Bytes per tier the cache holds at ``n_tokens`` (the memory model)."""
        return self.cost(config, spec, n_tokens, 0.0).memory


# ---- shared pieces of the memory models --------------------------------------------------------
def dense_token_bytes(spec: KVSpec) -> float:
    """Bytes of one token of one layer in the compute dtype (K and V)."""
    return spec.token_bytes()


def quantized_token_bytes(spec: KVSpec, bits: int, group: int, keys_per_token: bool = False) -> float:
    """Bytes of one token of one layer in a :class:`~hybridllm.kvcache.storage.QuantizedKV`:
    K and V codes, the keys' fp16 scale and zero per channel per ``group`` tokens (or, with
    ``keys_per_token``, per group of channels like the values), and the values' fp16 scale and
    zero per group of channels."""
    heads = spec.batch_size * spec.n_kv_heads
    codes = 2 * packed_size(spec.head_dim, bits)
    value_scales = 2 * _SCALE_BYTES * spec.head_dim // channel_group(spec.head_dim, group)
    key_scales = value_scales if keys_per_token else 2 * _SCALE_BYTES * spec.head_dim / group
    return heads * (codes + key_scales + value_scales)


def read_bytes(tokens: float, stored: float, compute: float) -> float:
    """Bytes to attend over ``tokens`` stored at ``stored`` bytes each: a format other than the
    compute dtype is counted as materialised into a compute-dtype copy (read, write, read back)."""
    return tokens * stored if stored == compute else tokens * (stored + 2 * compute)


def stored_dtype(config: KVConfig, spec: KVSpec) -> torch.dtype:
    """The dtype full-precision tokens are stored in (``--kv-dtype``: a dynamic cache's tokens, a
    quantized cache's residual; "auto": the compute dtype)."""
    return spec.dtype if config.kv_dtype == "auto" else getattr(torch, config.kv_dtype)


def stored_spec(config: KVConfig, spec: KVSpec) -> KVSpec:
    """``spec`` with the stored dtype (what a token's bytes are counted in)."""
    return dataclasses.replace(spec, dtype=stored_dtype(config, spec))
