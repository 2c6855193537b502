"""The model runner and the decode backends: every backend gives eager's greedy tokens, hidden
states are counted where they cross tiers, the backend is chosen at build time, and the model
itself has no attribute-dispatched paths. No wall-time assertions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from hybridllm.config import ModelConfig
from hybridllm.errors import ConfigError
from hybridllm.kernels import build
from hybridllm.kvcache import DynamicCache, KVSpec
from hybridllm.runtime.build import resolve_decode_backend
from hybridllm.loading.loader import load_model
from hybridllm.loading.registry import open_checkpoint
from hybridllm.models.llama import LlamaForCausalLM
from hybridllm.placement.apply import TierDevices
from hybridllm.placement.placement import Placement
from hybridllm.runtime.backends import BACKENDS
from hybridllm.runtime.runner import build_runner

CPU = torch.device("cpu")
MODELS_DIR = Path(__file__).resolve().parents[1] / "src" / "hybridllm" / "models"

try:
    build.find_compiler()
    HAVE_COMPILER = True
except build.KernelBuildError:
    HAVE_COMPILER = False


def _cache(config: ModelConfig) -> DynamicCache:
    return DynamicCache(KVSpec(config.n_layers, config.n_kv_heads, config.head_dim, torch.float32, CPU,
                               max_tokens=config.max_position_embeddings), page_size=16)


def _greedy(runner, steps: int = 8, prompt: int = 12) -> list[int]:
    cache = _cache(runner.config)
    ids = torch.randint(0, runner.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        last = runner(ids, cache, 0)
        tokens = []
        for _ in range(steps):
            tokens.append(int(last[0, -1].argmax()))
            last = runner(torch.tensor([tokens[-1:]]), cache, cache.seq_length)
    return tokens


def _runner(model, backend: str, placement: Placement | None = None):
    placement = placement or Placement.all_on_device(model.config.n_layers)
    return build_runner(model, placement, TierDevices(CPU), backend)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_backend_gives_the_eager_greedy_tokens(tiny_models, backend):
    if backend == "native" and not HAVE_COMPILER:
        pytest.skip("needs a C++ compiler for the native kernels")
    model = load_model(open_checkpoint(tiny_models["qwen2"][0]), torch.float32, lambda n: CPU)
    runner = _runner(model, backend)
    assert runner.report.backend == backend and runner.backend.name == backend
    assert _greedy(runner) == _greedy(_runner(model, "eager"))
    with torch.inference_mode():  # the model's own forward walks the same layers
        ids = torch.arange(5)[None]
        torch.testing.assert_close(runner(ids, _cache(model.config), 0, all_logits=True),
                                   model(ids, _cache(model.config), 0, all_logits=True), atol=1e-5, rtol=1e-5)


def _tiny_model(n_layers: int = 3) -> LlamaForCausalLM:
    config = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=n_layers,
                         n_heads=4, n_kv_heads=2, head_dim=8, max_position_embeddings=128)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("backend", ["eager", "native"])
def test_hops_are_counted_where_the_tier_changes(backend):
    if backend == "native" and not HAVE_COMPILER:
        pytest.skip("needs a C++ compiler for the native kernels")
    model = _tiny_model()
    hidden_bytes = model.config.hidden_size * 4  # one token's hidden state, float32
    # device -> host -> device, the CPU playing both tiers: two crossings per token
    runner = _runner(model, backend, Placement(["device", "host", "device"], embed_tier="device", head_tier="device"))
    assert [(s.tier, len(s.layers)) for s in runner.segments] == [("device", 1), ("host", 1), ("device", 1)]
    assert runner.report.build.whole_step == (backend == "native")  # the native hops are counted by the runner
    cache = _cache(model.config)
    with torch.inference_mode():
        runner(torch.arange(5)[None], cache, 0)  # prefill: 5 tokens cross twice
        assert runner.hop_bytes == 2 * 5 * hidden_bytes
        runner(torch.tensor([[7]]), cache, 5)  # a decode step (the native whole step counts the same)
        assert runner.hop_bytes == 2 * 6 * hidden_bytes
    # the last layer on the host and the head on the device: only the last position crosses to the head
    tail = _runner(model, backend, Placement(["device", "device", "host"], embed_tier="device", head_tier="device"))
    with torch.inference_mode():
        tail(torch.arange(5)[None], _cache(model.config), 0)
    assert tail.hop_bytes == 5 * hidden_bytes + hidden_bytes
    all_device = _runner(model, backend)
    with torch.inference_mode():
        all_device(torch.arange(5)[None], _cache(model.config), 0)
    assert all_device.hop_bytes == 0


def test_auto_picks_native_for_host_layers_and_eager_for_a_device():
    model = _tiny_model()
    placement = Placement.all_on_device(3)
    on_cpu = build_runner(model, placement, TierDevices(CPU))
    assert on_cpu.report.requested == "auto"
    assert on_cpu.report.backend == ("native" if HAVE_COMPILER else "eager")
    gpu = TierDevices(torch.device("cuda"))  # nothing is on the CPU: no host kernels to build
    assert build_runner(model, placement, gpu).report.backend == "eager"  # (nothing runs on it here)


def test_unknown_backend_is_a_config_error_listing_the_names(tiny_models):
    from hybridllm import LLM

    with pytest.raises(ConfigError, match="auto, eager, compiled, native, cuda-graph"):
        build_runner(_tiny_model(), Placement.all_on_device(3), TierDevices(CPU), "tensorrt")
    with pytest.raises(ConfigError, match="unknown decode backend 'fast'"):
        LLM(str(tiny_models["llama"][1]), decode_backend="fast")


def test_speed_flags_map_to_backends():
    assert resolve_decode_backend("auto", native_decode=True, compile=False) == "auto"
    assert resolve_decode_backend("auto", native_decode=False, compile=False) == "eager"
    assert resolve_decode_backend("auto", native_decode=True, compile=True) == "compiled"
    assert resolve_decode_backend("native", native_decode=True, compile=False) == "native"


def test_models_have_no_attribute_dispatch():
    """The model never asks what was attached to it: no hasattr/getattr/__dict__.get/_modules.get."""
    found = []
    for path in sorted(MODELS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("hasattr", "getattr"):
                found.append(f"{path.name}:{node.lineno} {func.id}")
            elif isinstance(func, ast.Attribute) and func.attr == "get" and isinstance(func.value, ast.Attribute) \
                    and func.value.attr in ("__dict__", "_modules"):
                found.append(f"{path.name}:{node.lineno} {func.value.attr}.get")
    assert found == []
