"""The planner's inputs: a model's numbers from its files, and the machine's figures (probed, given
or assumed) as a :class:`~hybridllm.planner.roofline.Hardware`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridllm.config import ModelConfig
from hybridllm.errors import ConfigError, ModelLoadError
from hybridllm.loading.local_models import model_name
from hybridllm.loading.registry import default_model_path, open_checkpoint
from hybridllm.planner.memory import GB
from hybridllm.planner.roofline import Hardware

# A GPU that is not probed (plan --vram on a machine without one): a typical 8 GiB consumer card.
DEFAULT_DEVICE_BANDWIDTH_GBS = 256.0  # achievable; RTX 4060 peaks at 272 GB/s, RTX 3060 Ti/3070 at 448 GB/s
DEFAULT_PCIE_GBS = 12.0  # achievable pinned copies over PCIe 4.0 x8 or 3.0 x16 (16 GB/s peak)
DEFAULT_DEVICE_TFLOPS = 20.0  # fp16 tensor-core matmuls reached by eager PyTorch on such a card
DEFAULT_DEVICE_LAYER_OVERHEAD_S = 100e-6  # ~20 kernel launches per eager decoder layer at ~5 us
DEFAULT_DEVICE_TOKEN_OVERHEAD_S = 500e-6  # embedding, head, sampling, the logits' copy and sync
# Host figures when the probe is skipped (tests, or every figure given): a 2-channel DDR4 desktop.
DEFAULT_HOST_BANDWIDTH_GBS = 20.0
DEFAULT_HOST_GFLOPS = 200.0
DEFAULT_HOST_LAYER_OVERHEAD_S = 150e-6
DEFAULT_HOST_TOKEN_OVERHEAD_S = 1e-3


def load_model_config(model: str | Path | None) -> tuple[ModelConfig, str, bool]:
    """(config, display name, whether it has weights) of a GGUF file, an HF folder or a config.json.

    A ``config.json`` (or a folder holding only one) gives the numbers without any weights. A
    model's display name is its one name (:func:`~hybridllm.loading.local_models.model_name`).
    """
    if model is None:
        model = default_model_path()
    path = Path(model).expanduser()
    config_file = None
    if path.suffix == ".json":
        config_file = path
    elif path.is_dir() and (path / "config.json").is_file() and not any(path.glob("*.safetensors")):
        config_file = path / "config.json"
    if config_file is None:
        checkpoint = open_checkpoint(path)
        return checkpoint.config, model_name(checkpoint.path), True
    try:
        data = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"model config not found: {config_file}") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file}: invalid JSON ({exc.msg}, line {exc.lineno})") from None
    try:
        cfg = ModelConfig.from_hf_dict(data)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ModelLoadError(f"{config_file}: not a Hugging Face model config ({type(exc).__name__}: {exc})") from None
    return cfg, config_file.name if config_file.name != "config.json" else config_file.parent.name, False


def hardware_from(profile: Any | None, vram: int | None = None, ram: int | None = None,
                  device_bandwidth_gbs: float | None = None, pcie_gbs: float | None = None,
                  host_bandwidth_gbs: float | None = None, device_tflops: float | None = None
                  ) -> tuple[Hardware, dict[str, str]]:
    """Combine a ``MachineProfile`` (or None) with explicit figures; say where each came from.

    A GPU is planned for when one was probed or ``vram`` is given; otherwise the CPU stands in.
    """
    sources: dict[str, str] = {}

    def pick(name: str, given: float | None, probed: float | None, default: float, unit: float = 1.0) -> float:
        if given is not None:
            sources[name] = "given"
            return given * unit
        if probed:
            sources[name] = "probed"
            return probed * unit
        sources[name] = "assumed"
        return default * unit

    gpu = getattr(profile, "gpu", None)
    host_bw = pick("host_bandwidth", host_bandwidth_gbs, getattr(profile, "host_bandwidth_gbs", None),
                   DEFAULT_HOST_BANDWIDTH_GBS, GB)
    host_flops = pick("host_flops", None, getattr(profile, "model_flops", None) or getattr(profile, "host_flops", None),
                      DEFAULT_HOST_GFLOPS * 1e9)
    host_layer = pick("host_layer_overhead", None, getattr(profile, "host_layer_overhead_s", None),
                      DEFAULT_HOST_LAYER_OVERHEAD_S)
    host_token = pick("host_token_overhead", None, getattr(profile, "host_token_overhead_s", None),
                      DEFAULT_HOST_TOKEN_OVERHEAD_S)
    if ram is None:
        ram = (profile.ram_budget_bytes or None) if profile is not None else None
        sources["ram"] = "available" if ram is not None else "unknown"
        if ram is None:
            raise ConfigError("no RAM budget: give --ram (e.g. --ram 32GiB)")
    else:
        sources["ram"] = "given"
    has_device = gpu is not None or vram is not None
    if not has_device:
        for name in ("device_bandwidth", "pcie_bandwidth", "device_flops"):
            sources.pop(name, None)
        return Hardware.cpu_only(ram, host_bw, host_flops, host_layer, host_token), sources
    if vram is None:
        vram = gpu.vram_free_bytes
        sources["vram"] = "free"
    else:
        sources["vram"] = "given"
    return Hardware(
        has_device=True,
        device_budget=vram,
        host_budget=ram,
        device_bandwidth=pick("device_bandwidth", device_bandwidth_gbs,
                              getattr(gpu, "model_gemv_gbs", None) or getattr(gpu, "bandwidth_gbs", None),
                              DEFAULT_DEVICE_BANDWIDTH_GBS, GB),
        host_bandwidth=host_bw,
        pcie_bandwidth=pick("pcie_bandwidth", pcie_gbs, getattr(gpu, "pcie_gbs", None), DEFAULT_PCIE_GBS, GB),
        device_flops=pick("device_flops", device_tflops, getattr(gpu, "model_flops", None) or getattr(gpu, "flops", None),
                          DEFAULT_DEVICE_TFLOPS * 1e12, 1e12 if device_tflops is not None else 1.0),
        host_flops=host_flops,
        device_layer_overhead_s=pick("device_layer_overhead", None, getattr(gpu, "layer_overhead_s", None),
                                     DEFAULT_DEVICE_LAYER_OVERHEAD_S),
        host_layer_overhead_s=host_layer,
        device_token_overhead_s=pick("device_token_overhead", None, getattr(gpu, "token_overhead_s", None),
                                     DEFAULT_DEVICE_TOKEN_OVERHEAD_S),
        host_token_overhead_s=host_token,
    ), sources
