"""Named grids. Flags given on the command line override a preset's values.

Each preset replaces what used to be a script of its own: ``peers`` the foundation comparison
with llama.cpp and transformers, ``kv`` every KV strategy side by side, ``planner`` the
planner's predicted vs measured decode speed (measured in this process, see
``hybridllm.bench.planner_accuracy``).
"""

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
    # The foundation comparison with the peers; prints the table with the ratio to llama.cpp and,
    # with --markdown, the section of docs/benchmarks.md (machine, command, load average).
    "peers": {
        "contexts": [16, 512, 1500],
        "kv_caches": ["dynamic"],
        "decode_ons": [None],
        "baselines": ["llama.cpp", "transformers"],
        "new_tokens": 128,
        "repeat": 1,
    },
    # Decode/prefill speed vs the peers on the default model with its quantization kept (issue 8);
    # the report adds the ratio to llama.cpp and the fraction of the bandwidth limit reached. The
    # KV is stored in float16 as llama.cpp's default cache is (the same bytes per token to read;
    # float32 arithmetic in both), so the comparison is like for like.
    "speed": {
        "contexts": [16, 512, 2048, 8064],  # 8064 + 128 new tokens = the default model's 8K window
        "kv_options": {"kv_dtype": "float16"},
        "kv_caches": ["dynamic"],
        "decode_ons": [None],
        "baselines": ["llama.cpp", "transformers"],
        "new_tokens": 128,
        "repeat": 3,
        "weights": "auto",
    },
    # Every KV strategy and its main variants side by side (hybridllm.bench.kv_strategies): decode
    # speed, peak KV bytes per tier, bus traffic, pages moved. Contexts beyond the default model's
    # window run on a random-weights model of its shape with the window raised.
    # With --baseline llama.cpp, llama.cpp runs its f16, q8_0 and q4_0 KV types beside (the table's
    # "vs llama.cpp" compares our int8 / int4 KV with its q8_0 / q4_0 at the same context).
    "kv": {
        "contexts": [1024, 4096, 16384],
        "kv_caches": ["dynamic", "offloaded", "quantized", "tiered", "host"],
        "kv_variants": ["dynamic", "offloaded", "quantized-int8", "quantized-int4", "tiered", "tiered-cold4", "host"],
        "llama_cpp_caches": ["f16", "q8_0", "q4_0"],
        "long_context": "random",
        "decode_ons": [None],
        "baselines": [],
        "new_tokens": 16,
        "repeat": 1,
    },
    # The planner's prediction next to the measured decode speed of the default model on this
    # machine (hybridllm.bench.planner_accuracy): best of ``repeat`` generations per context.
    "planner": {
        "contexts": [512, 4096],
        "kv_caches": ["dynamic"],
        "decode_ons": [None],
        "baselines": [],
        "new_tokens": 64,
        "repeat": 3,
    },
    # Speculative decoding on input-grounded prompts and free-form chat (hybridllm.bench.workloads,
    # hybridllm.bench.spec_report): ours without and with --spec ngram, llama-cpp-python without and
    # with LlamaPromptLookupDecoding, on the same file, prompt ids and threads, in one sweep; then
    # `serve` without and with --spec ngram under 16 concurrent chat requests (hybridllm.bench.spec_serve,
    # --repeat bursts each, at most serve_new_tokens new tokens per request).
    "spec": {
        "workloads": ["rewrite", "quote", "chat"],
        "specs": ["none", "ngram"],
        "kv_caches": ["dynamic"],
        "decode_ons": [None],
        "baselines": ["llama.cpp"],
        "new_tokens": 768,
        "repeat": 3,
        "weights": "auto",
        "serve_concurrency": 16,
        "serve_new_tokens": 128,
    },
    # What the prefix cache saves a chat (hybridllm.bench.multi_turn): a ~4K-token system prompt and
    # --turns user turns, TTFT per turn with the prefix cache off and on, and a restart from disk.
    "multi-turn": {
        "contexts": [4096],
        "kv_caches": ["dynamic"],
        "decode_ons": [None],
        "baselines": [],
        "new_tokens": 32,
        "repeat": 1,
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
    "specs": ["none"],
    "workloads": None,  # None: the synthetic prompt of each --prompt-tokens length
    "serve_concurrency": 0,  # > 0: after the sweep, serve without and with --spec ngram under that many requests
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


def build_preset_grid(settings: dict[str, Any], **common: Any) -> list:
    """The sweep's configurations for resolved ``settings``.

    With ``kv_variants`` (``--preset kv``) our engine runs every variant whose strategy is among
    ``settings["kv_caches"]`` (so ``--kv-cache tiered`` keeps tiered and tiered-cold4), and the
    peers, if any, are added per context; otherwise the plain grid of ``build_grid``.
    """
    from hybridllm.bench.sweep import build_grid

    if settings.get("workloads"):  # named prompts: each its own length (our tokenizer's) and answer cap
        from hybridllm.bench.workloads import MAX_NEW_TOKENS

        return [config for workload in settings["workloads"]
                for config in build_grid([workload_length(workload, common)], settings["kv_caches"],
                                         settings["decode_ons"], settings["n_gpu_layers"], settings["baselines"],
                                         specs=settings["specs"], workload=workload,
                                         **{**common, "new_tokens": min(common["new_tokens"],
                                                                        MAX_NEW_TOKENS[workload])})]
    if not settings.get("kv_variants"):
        return build_grid(settings["contexts"], settings["kv_caches"], settings["decode_ons"],
                          settings["n_gpu_layers"], settings["baselines"], specs=settings["specs"], **common)
    from hybridllm.bench.kv_strategies import KV_VARIANTS, build_variant_grid

    if settings["specs"] != ["none"]:
        from hybridllm.errors import ConfigError

        raise ConfigError("--preset kv measures the KV strategies without speculation; drop --spec")
    variants = [v for v in settings["kv_variants"] if KV_VARIANTS[v][0] in settings["kv_caches"]]
    ours = build_variant_grid(settings["contexts"], variants, settings["decode_ons"], settings["n_gpu_layers"],
                              long_context=settings.get("long_context", "skip"), **common)
    peers = build_grid(settings["contexts"], settings["kv_caches"], settings["decode_ons"], settings["n_gpu_layers"],
                       settings["baselines"], include_ours=False,
                       llama_cpp_caches=settings.get("llama_cpp_caches", ("f16",)), **common)
    return sorted(ours + peers, key=lambda config: config.context)  # stable: ours first at each context


def workload_length(workload: str, common: dict[str, Any]) -> int:
    """The prompt tokens of a named workload for the sweep's model (our tokenizer of it)."""
    from hybridllm.bench.sweep import BenchConfig
    from hybridllm.bench.workloads import workload_prompt_ids
    from hybridllm.errors import ConfigError

    if common.get("random_weights"):
        raise ConfigError("the named workloads are text: they need a model with a tokenizer, not --random-weights")
    return len(workload_prompt_ids(workload, BenchConfig(**common).checkpoint().tokenizer()))
