"""Named grids. Flags given on the command line override a preset's values."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # The study's grid: 1K-128K contexts (as far as memory allows: a series stops at its first
    # out-of-memory), four strategies, decode on the device and on the host.
    "paper": {
        "contexts": [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072],
        "kv_caches": ["dynamic", "offloaded", "quantized", "tiered"],
        "decode_ons": ["device", "host"],
        "baselines": [],
        "new_tokens": 128,
        "repeat": 3,
    },
    # The foundation comparison with the peers (bench/compare_peers.py).
    "peers": {
        "contexts": [16, 512, 1500],
        "kv_caches": ["dynamic"],
        "decode_ons": [None],
        "baselines": ["llama.cpp", "transformers"],
        "new_tokens": 128,
        "repeat": 1,
    },
    # Decode/prefill speed vs the peers on the default model with its quantization kept (issue 8);
    # the report adds the ratio to llama.cpp and the fraction of the bandwidth limit reached.
    "speed": {
        "contexts": [16, 512, 1500, 8064],  # 8064 + 128 new tokens = the default model's 8K window
        "kv_caches": ["dynamic"],
        "decode_ons": [None],
        "baselines": ["llama.cpp", "transformers"],
        "new_tokens": 128,
        "repeat": 3,
        "weights": "auto",
    },
}

DEFAULTS: dict[str, Any] = {
    "contexts": [512],
    "kv_caches": ["dynamic"],
    "decode_ons": [None],
    "n_gpu_layers": [None],
    "baselines": [],
    "new_tokens": 128,
    "repeat": 3,
}


def resolve(preset: str | None, **given: Any) -> dict[str, Any]:
    """The grid settings: defaults, then the preset, then every value that was given (not None)."""
    from hybridllm.errors import ConfigError

    settings = dict(DEFAULTS)
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        settings.update(PRESETS[preset])
    settings.update({k: v for k, v in given.items() if v is not None})
    return settings
