"""What one loaded model needs to run requests: its runners, tokenizer, KV factory and facts.

A :class:`Runtime` is built once by :func:`hybridllm.runtime.build.build_runtime` and then only
read: the request loop (:mod:`hybridllm.engine.scheduler`) asks it for runners and caches, the
facade and the tools read its facts (placement, bytes per tier, cold start).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridllm.config import EngineConfig, KVConfig, ModelConfig, SpeculativeConfig
from hybridllm.errors import ConfigError
from hybridllm.kvcache.attention import HostAttention, layer_attention
from hybridllm.kvcache.base import KVCache, KVSpec, MemoryLedger
from hybridllm.kvcache.dynamic import DynamicCache
from hybridllm.kvcache.factory import create_cache
from hybridllm.placement.apply import TierDevices
from hybridllm.placement.placement import Placement
from hybridllm.runtime.migration import PhaseMigration
from hybridllm.timing import ColdStart


@dataclass
class Runtime:
    """A built model, ready for the request loop.

    Attributes:
        checkpoint: where the weights came from (its ``path`` names the served model).
        config: the architecture numbers.
        engine_config: device, dtype, prefill chunk, threads.
        placement: where every layer, the KV and decoding live.
        devices: the real device of each tier.
        tokenizer: the model's tokenizer.
        runner: runs the model as placed (prefill, and decode unless it migrates).
        cold_start: the build's phases (seconds).
        weight_bytes: weight bytes per tier (the host copy of phase migration included once made).
        decode_weight_bytes: weight bytes one decode step reads.
        weights_format: "int4", "int8", "float32", ... (what the matrices run as).
        build_host_runner: makes the host runner for phase migration (called once, on first need).
        native_kv: whether the native steps read the KV strategy's stores in place (False where the
            kernels run no layer, or cannot read the strategy: its attention then runs in PyTorch).
        host_attention: how the caches attend KV held in host RAM in place when the compute
            device is another (the native kernels; None: PyTorch over the rows read out).
        speculative: speculative decoding's settings (``--spec``, ``--draft-max`` ...).
        draft: the draft model's runtime (``--model-draft``; same vocabulary), else None.
        activations: how the native products round the inputs of the file's quantized types
            (``--activations``: "exact" or "int8").
    """

    checkpoint: Any
    config: ModelConfig
    engine_config: EngineConfig
    placement: Placement
    devices: TierDevices
    tokenizer: Any
    runner: Any  # hybridllm.runtime.runner.ModelRunner
    cold_start: ColdStart
    weight_bytes: dict[str, int]
    decode_weight_bytes: int
    weights_format: str
    build_host_runner: Callable[[], tuple[Any, dict[str, int]]]
    native_kv: bool = False
    host_attention: HostAttention | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    draft: Runtime | None = None
    activations: str = "exact"
    _migration: PhaseMigration | None = field(default=None, repr=False)

    @property
    def kv_attention(self) -> str:
        """Who attends the KV, in words (the bench's rows name it): "native" (the kernels read
        the strategy's stores in place), "PyTorch, host part native" (split attention on a GPU),
        or "PyTorch"."""
        if self.native_kv:
            return "native"
        return "PyTorch, host part native" if self.host_attention is not None else "PyTorch"

    @property
    def kv_config(self) -> KVConfig:
        return self.placement.kv

    @property
    def context_length(self) -> int:
        """Tokens a sequence may hold (prompt + generated): the model's window, or ``--ctx-size``."""
        return self.engine_config.context_length(self.config.max_position_embeddings)

    @property
    def context_description(self) -> str:
        """The context limit in words: the user's ``--ctx-size`` cap or the model's window (messages)."""
        return self.engine_config.describe_context(self.config.max_position_embeddings)

    # ---- KV ------------------------------------------------------------------------------
    def kv_spec(self) -> KVSpec:
        """Shape and devices of this model's KV."""
        cfg = self.config
        return KVSpec(
            n_layers=cfg.n_layers,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.engine_config.torch_dtype,
            device=self.devices.device,
            host_device=self.devices.host,
            max_tokens=self.context_length,
            attention=layer_attention(cfg, self.context_length),
            host_attention=self.host_attention,
        )

    def kv_ledger(self, host_budget: int | None = None) -> MemoryLedger:
        """A KV ledger: the device tier gets what the VRAM budget leaves after the weights;
        ``host_budget`` bounds the host tier (None: unbounded)."""
        budget = self.kv_config.vram_budget
        device_budget = None
        if budget is not None:
            device_budget = budget - self.weight_bytes["device"]
            if device_budget <= 0:
                raise ConfigError(
                    f"the weights on the device take {self.weight_bytes['device']} bytes, more than the VRAM budget "
                    f"of {budget} bytes; raise --vram-budget or place fewer layers on the device"
                )
        return MemoryLedger({"device": device_budget, "host": host_budget}, threshold=self.kv_config.kv_threshold)

    def new_cache(self, ledger: MemoryLedger | None = None) -> KVCache:
        """An empty KV cache following the KV policy, accounted in ``ledger`` (None: a fresh one); the
        decode backend's own cache where its step needs one (``cuda-graph``: a static row)."""
        spec, ledger = self.kv_spec(), ledger if ledger is not None else self.kv_ledger()
        own = self.runner.backend.new_cache(spec, ledger)
        if own is not None:
            return own
        return create_cache(self.kv_config, spec, ledger, layer_tiers=self.placement.layer_tiers)

    def new_host_cache(self, ledger: MemoryLedger | None = None) -> DynamicCache:
        """An empty cache with every layer's KV in host RAM (where decoding continues after
        phase migration)."""
        return DynamicCache(self.kv_spec(), ledger if ledger is not None else self.kv_ledger(),
                            page_size=self.kv_config.kv_page_size, tier="host")

    # ---- decoding on the host ------------------------------------------------------------
    def migration(self) -> PhaseMigration:
        """Decoding on the host: the host runner (its weights copied once, on first use) and host caches."""
        if self._migration is None:
            runner, host_weight_bytes = self.build_host_runner()
            self.weight_bytes["host"] = host_weight_bytes["host"]
            self._migration = PhaseMigration(runner, self.new_host_cache)
        return self._migration

    @property
    def host_runner(self) -> Any | None:
        """The host runner if phase migration has built it, else None."""
        return None if self._migration is None else self._migration.runner
