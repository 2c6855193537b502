"""Native decode kernels (``hybridllm.kernels``): each kernel against its PyTorch reference, the
native decode step against the PyTorch step (float, int4, int8 weights; every tiny architecture),
where it applies and where the PyTorch step must run instead, and the fallback when the kernels
cannot be built. No wall-time assertions.

The kernels need a C++ compiler; without one these tests are skipped (like the CUDA ones) and
the engine runs its PyTorch steps.
"""

from __future__ import annotations

import logging

import pytest
import torch

from hybridllm.kernels import build, native
from hybridllm.kvcache import DynamicCache, KVSpec
from hybridllm.kvcache.attention import causal_attention
from hybridllm.loading.loader import load_model
from hybridllm.loading.registry import open_checkpoint
from hybridllm.models.quantized import Int4Linear, dequantize_model, quantize_model
from hybridllm.placement.apply import TierDevices
from hybridllm.placement.placement import Placement
from hybridllm.runtime.runner import build_runner

from conftest import ARCHS, NEEDS_COMPILER
from linear_modules import exact_product, linear_module

CPU = torch.device("cpu")

pytestmark = NEEDS_COMPILER


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- kernels ------------------------------------------------------------------------------------
@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
@pytest.mark.parametrize("kind, n, k", [
    ("float", 98, 100),  # rows beyond the 4-row blocks, inputs beyond the 16-wide vectors
    ("float_bias", 64, 576),
    ("int4", 96, 576),
    ("int4_bias", 160, 1536),
    ("int8", 98, 128),
    ("int8_groups", 98, 576),  # the Q8_0 head/embedding table
])
def test_linear_kernel_matches_the_dequantized_product(kind, n, k, isa, request):
    library = None if isa == "native" else request.getfixturevalue(f"{isa}_library")
    module = linear_module(kind, n, k)
    x = torch.randn(3, k, generator=_gen(7))
    out = native.linear(native.linear_view(module), x, library=library)
    expected = exact_product(module, x).float()
    if kind.startswith("float"):  # float32 products: summation order only
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    else:  # integer dots over two int8 digits per activation (~15 bits)
        scale = expected.abs().max().item()
        torch.testing.assert_close(out, expected, atol=5e-4 * scale, rtol=1e-3)


def test_int4_blocks_pad_rows_beyond_a_block():
    n, k = 98, 64  # Int4Linear needs N % 16 == 0; the block layout itself takes any N
    codes = torch.randint(0, 16, (n, k), generator=_gen(2), dtype=torch.uint8)
    scales_and_zeros = torch.rand(k // 32, n, 2, generator=_gen(3)).to(torch.bfloat16)
    blocks = native.pack_int4_blocks(codes, scales_and_zeros)
    assert blocks.shape == (7, 2, 320)  # 16-row blocks, the last one padded
    unpacked_codes, unpacked_sz = native.unpack_int4_blocks(blocks, n, k)
    assert torch.equal(unpacked_codes, codes) and torch.equal(unpacked_sz, scales_and_zeros)
    view = native.LinearView(native.HLLinear(native.FORMAT_Q4, 0, n, k, blocks.data_ptr(), 0, 0, native.EXACT_DIGITS), [blocks])
    sz = scales_and_zeros.float()
    weight = ((codes.float().reshape(n, 2, 32) - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None])
    x = torch.randn(1, k, generator=_gen(4))
    expected = x @ weight.reshape(n, k).T
    torch.testing.assert_close(native.linear(view, x), expected, atol=5e-4 * expected.abs().max().item(), rtol=1e-3)


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim, total", [
    (9, 3, 64, 1),      # the first token
    (9, 3, 64, 1000),   # many chunks per KV head
    (8, 8, 32, 70),     # no grouping
    (14, 2, 64, 300),   # 7 queries per KV head (Qwen2-0.5B)
    (16, 1, 128, 200),  # 16 queries per KV head: the generic score loop
    (4, 2, 40, 50),     # a head size that is not a multiple of 16
    (4, 2, 20, 50),     # nor of 8: the generic score loop
])
def test_attention_kernel_matches_causal_attention(n_heads, n_kv_heads, head_dim, total, isa, request):
    library = None if isa == "native" else request.getfixturevalue(f"{isa}_library")
    gen = _gen(total + head_dim)
    capacity = total + 17  # rows beyond `total` must be ignored
    q = torch.randn(n_heads, head_dim, generator=gen)
    keys = torch.randn(n_kv_heads, capacity, head_dim, generator=gen) * 3
    values = torch.randn(n_kv_heads, capacity, head_dim, generator=gen)
    out = native.attention(q, keys, values, total, library=library)
    expected = causal_attention(q[None, :, None], keys[None, :, :total], values[None, :, :total], total - 1)
    torch.testing.assert_close(out, expected[0, :, 0], atol=2e-5, rtol=2e-5)


# ---- the decode step ----------------------------------------------------------------------------
def _load(tiny_models, arch: str, weights: str = "float"):
    folder = tiny_models[arch][0]
    model = load_model(open_checkpoint(folder), torch.float32, lambda n: CPU)
    if weights != "float":
        quantize_model(model, weights)
    return model


def _runner(model, backend: str):
    return build_runner(model, Placement.all_on_device(model.config.n_layers), TierDevices(CPU), backend)


def _cache(model, **kwargs) -> DynamicCache:
    c = model.config
    return DynamicCache(KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, CPU,
                               max_tokens=c.max_position_embeddings), page_size=16, **kwargs)


def _greedy(model, cache, steps: int = 12, prompt: int = 20) -> tuple[torch.Tensor, list[int]]:
    """Prefill a seeded prompt, then ``steps`` greedy tokens; the decode steps' logits (steps, vocab)."""
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=_gen(5))
    with torch.inference_mode():
        last = model(ids, cache, 0)
        logits, tokens = [], []
        for _ in range(steps):
            token = int(last[0, -1].argmax())
            tokens.append(token)
            last = model(torch.tensor([[token]]), cache, cache.seq_length)
            logits.append(last[0, -1])
    return torch.stack(logits), tokens


def _count_native_steps(monkeypatch) -> dict[str, int]:
    counts = {"model": 0, "layer": 0}
    model_decode, layer_step = native.NativeModel.decode, native.NativeDecodeLayer.step

    def counting_decode(self, *args):
        counts["model"] += 1
        return model_decode(self, *args)

    def counting_step(self, *args):
        counts["layer"] += 1
        return layer_step(self, *args)

    monkeypatch.setattr(native.NativeModel, "decode", counting_decode)
    monkeypatch.setattr(native.NativeDecodeLayer, "step", counting_step)
    return counts


@pytest.mark.parametrize("arch", ARCHS)
def test_native_decode_equals_the_pytorch_step_on_float_weights(tiny_models, arch, monkeypatch):
    reference = _runner(_load(tiny_models, arch), "eager")
    model = _runner(_load(tiny_models, arch), "native")
    report = model.report.build
    assert report.kernel_layers == model.config.n_layers and report.head and report.whole_step
    counts = _count_native_steps(monkeypatch)
    expected_logits, expected_tokens = _greedy(reference, _cache(reference))
    logits, tokens = _greedy(model, _cache(model))
    assert counts["model"] == 12  # every decode step ran natively, in one call
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_native_decode_of_quantized_weights_matches_their_float_product(tiny_models, weights):
    model = _runner(_load(tiny_models, "llama", weights), "native")
    assert model.report.build.whole_step
    # The reference: the same model with every quantized projection dequantized to float32.
    reference = _runner(dequantize_model(_load(tiny_models, "llama", weights)), "eager")
    # A one-token prompt: every step, the first included, is a decode step (the prefill of longer
    # prompts rounds to bfloat16 where the CPU has bf16 dot products, as PyTorch's int4 kernel does).
    prompt = 1
    expected_logits, expected_tokens = _greedy(reference, _cache(reference), prompt=prompt)
    logits, tokens = _greedy(model, _cache(model), prompt=prompt)
    assert tokens == expected_tokens
    scale = expected_logits.abs().max().item()
    torch.testing.assert_close(logits, expected_logits, atol=2e-3 * scale, rtol=1e-3)


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_linear_kernel_reads_each_weight_block_once_for_several_rows(rows):
    """hl_linear over M rows equals M one-row calls (the rows share each weight block's read)."""
    module = Int4Linear.from_float(torch.randn(96, 128, generator=_gen(8)), torch.randn(96, generator=_gen(9)))
    view = native.linear_view(module)
    x = torch.randn(rows, 128, generator=_gen(rows))
    together = native.linear(view, x)
    one_by_one = torch.cat([native.linear(view, x[i:i + 1]) for i in range(rows)])
    torch.testing.assert_close(together, one_by_one, atol=0, rtol=0)


def test_layers_the_kernels_cannot_run_keep_their_pytorch_step(tiny_models, monkeypatch):
    reference, model = _load(tiny_models, "llama"), _load(tiny_models, "llama")
    # A projection in a format the kernels do not read (bfloat16 weights computing in float32).
    for loaded in (reference, model):
        loaded.model.layers[0].self_attn.o_proj = _Bf16Linear(loaded.model.layers[0].self_attn.o_proj)
    reference, model = _runner(reference, "eager"), _runner(model, "native")
    report = model.report.build
    assert report.kernel_layers == model.config.n_layers - 1 and not report.whole_step
    assert any(note.startswith("layer 0:") for note in report.skipped)
    counts = _count_native_steps(monkeypatch)
    expected_logits, expected_tokens = _greedy(reference, _cache(reference), steps=6)
    logits, tokens = _greedy(model, _cache(model), steps=6)
    assert counts["model"] == 0 and counts["layer"] == 6 * (model.config.n_layers - 1)
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


class _Bf16Linear(torch.nn.Module):
    """A float32-in, float32-out projection whose weight is stored in bfloat16."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.in_features, self.out_features, self.bias = linear.in_features, linear.out_features, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.float().T


@pytest.mark.parametrize("kv_cache", ["tiered", "quantized", "offloaded", "host"])
def test_every_strategy_decodes_natively(tiny_models, kv_cache, monkeypatch):
    from hybridllm import LLM, SamplingParams

    counts = _count_native_steps(monkeypatch)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    gguf = str(tiny_models["llama"][1])
    native_llm = LLM(gguf, threads=2, kv_cache=kv_cache)
    plain_llm = LLM(gguf, threads=2, kv_cache=kv_cache, native_decode=False)
    assert native_llm.runner.report.build.whole_step and native_llm.runtime.native_kv
    assert native_llm.generate("Hello", params).token_ids == plain_llm.generate("Hello", params).token_ids
    assert counts == {"model": 5, "layer": 0}  # every decode step after the first token: one native call


def test_split_placement_counts_the_same_hops_natively(tiny_models, monkeypatch):
    from hybridllm import LLM, SamplingParams

    counts = _count_native_steps(monkeypatch)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    results = []
    for native_decode in (True, False):
        # The CPU plays the device: layer 0 in the device tier, layer 1 and the head on the host.
        llm = LLM(str(tiny_models["llama"][1]), threads=2, n_gpu_layers=1, native_decode=native_decode)
        llm.runner.hop_bytes = 0
        result = llm.generate("The sky is", params)
        results.append((result.token_ids, llm.runner.hop_bytes))
    assert counts["model"] == 7  # decode steps after the first token, all native
    assert results[0] == results[1]
    assert results[0][1] > 0


@pytest.mark.slow
def test_default_model_int4_native_decode_is_closer_to_exact_than_pytorch(shared_llm):
    """On the default model's Q4_1/Q8_0 weights, native decode logits stay at least as close to
    the float product over the dequantized weights as PyTorch's bfloat16 int4 kernel."""
    from hybridllm import LLM

    def decode_logits(llm) -> torch.Tensor:
        ids = torch.randint(0, 5000, (1, 40), generator=_gen(1))
        cache = llm.new_cache()
        with torch.inference_mode():
            llm.runner(ids[:, :24], cache, 0)
            return torch.stack([llm.runner(ids[:, i:i + 1], cache, i)[0, -1] for i in range(24, 40)])

    def kl(x: torch.Tensor, exact: torch.Tensor) -> float:
        return torch.nn.functional.kl_div(x.log_softmax(-1), exact.log_softmax(-1), log_target=True,
                                          reduction="batchmean").item()

    native_llm = shared_llm(weights="auto", threads=2)
    assert native_llm.runner.report.build.whole_step
    pytorch_llm = shared_llm(weights="auto", threads=2, native_decode=False)
    exact_llm = LLM(weights="auto", threads=2, native_decode=False)
    dequantize_model(exact_llm.model)
    exact = decode_logits(exact_llm)
    native_kl, pytorch_kl = kl(decode_logits(native_llm), exact), kl(decode_logits(pytorch_llm), exact)
    assert native_kl <= pytorch_kl
    assert native_kl < 1e-3


def test_without_a_compiler_the_model_keeps_its_pytorch_steps(tiny_models, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("HYBRIDLLM_KERNEL_CACHE", str(tmp_path / "kernels"))
    build.load_decode_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            model = _runner(_load(tiny_models, "llama"), "auto")
        assert model.report.backend == "eager" and model.report.requested == "auto"
        assert any("native decode unavailable" in note for note in model.report.notes)
        assert "no C++ compiler found" in caplog.text
        reference = _runner(_load(tiny_models, "llama"), "eager")
        assert _greedy(model, _cache(model), steps=4)[1] == _greedy(reference, _cache(reference), steps=4)[1]
    finally:
        build.load_decode_library.cache_clear()


def test_a_compile_error_is_one_line(tmp_path, monkeypatch):
    broken = tmp_path / "decode.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(build, "UNITS", (broken, *build.UNITS[1:]))
    monkeypatch.setenv("HYBRIDLLM_KERNEL_CACHE", str(tmp_path / "kernels"))
    with pytest.raises(build.KernelBuildError) as error:
        build.build_library()
    assert "compiling decode.cpp failed" in str(error.value) and "\n" not in str(error.value)
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-written is left to load


def test_host_decode_copy_gets_its_own_native_steps(tiny_models, monkeypatch):
    from hybridllm import LLM, SamplingParams

    gguf = str(tiny_models["llama"][1])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(gguf, threads=2, n_gpu_layers=1, decode_on="host")
    decode_runner = llm.phase_migration().runner
    assert decode_runner.model is not llm.model
    assert decode_runner.placement.layer_tiers == ["host", "host"]
    assert decode_runner.report.build.whole_step  # built for the copy: every layer is on the host
    assert decode_runner.backend is not llm.runner.backend
    counts = _count_native_steps(monkeypatch)
    tokens = llm.generate("The sky is", params).token_ids
    assert counts["model"] == 7
    plain = LLM(gguf, threads=2, n_gpu_layers=1, decode_on="host", native_decode=False)
    assert plain.generate("The sky is", params).token_ids == tokens


def test_in_place_rows_only_where_a_kernel_can_write_the_buffer():
    from hybridllm.kvcache.batch import BatchedCaches

    spec = KVSpec(2, 2, 16, torch.float32, CPU, max_tokens=64)
    one, two = DynamicCache(spec), DynamicCache(spec)
    rows = BatchedCaches([one]).in_place_rows([0, 1], 1)  # a batch of one is its sequence's cache
    assert rows.start == 0 and one.length(0) == 1 and rows.runs[0]["capacity"][0] == one.capacity(0)
    assert one.in_place_rows([0, 1], 1).start == 1 and one.length(0) == 2
    assert BatchedCaches([one]).supports_in_place(1)
    assert not BatchedCaches([one, two]).supports_in_place(0)
    with pytest.raises(ValueError, match="batch of one"):
        BatchedCaches([one, two]).in_place_rows([0], 1)
    assert not DynamicCache(KVSpec(2, 2, 16, torch.bfloat16, CPU)).supports_in_place(0)  # the kernels read float32
    assert not DynamicCache(KVSpec(2, 2, 16, torch.float32, CPU, batch_size=2)).supports_in_place(0)


def test_in_place_rows_of_every_layer_as_of_each_layer():
    """A whole-model step claims every layer of a cache in one call: the same start, buffers and
    lengths as claiming layer by layer; the buffers' addresses are read again after a reallocation."""
    from hybridllm.kvcache.base import InPlaceRows

    spec = KVSpec(3, 2, 16, torch.float32, CPU, max_tokens=512)
    fast, generic = DynamicCache(spec, page_size=16), DynamicCache(spec, page_size=16)
    layers = [0, 1, 2]
    for n_new in (5, 1, 40):  # the last one outgrows the first allocation
        rows = fast.in_place_rows(layers, n_new)
        per_layer = [generic.in_place_rows([i], n_new) for i in layers]
        assert isinstance(rows, InPlaceRows) and rows.start == per_layer[0].start
        run = rows.runs[0]
        assert run["capacity"] == [r.runs[0]["capacity"][0] for r in per_layer]
        assert run["k"] == [fast._stores[i].buffers()[0].data_ptr() for i in layers]
        assert run["v"] == [fast._stores[i].buffers()[1].data_ptr() for i in layers]
        assert rows.window == [0, 0, 0] and rows.write == 0 and rows.write_row == rows.start
        assert [fast.length(i) for i in layers] == [generic.length(i) for i in layers] == [rows.start + n_new] * 3
    assert fast.seq_length == 46 and min(run["capacity"]) >= 46
    with pytest.raises(ValueError, match="KV cache full"):
        fast.in_place_rows(layers, 500)
    assert fast.supports_in_place_layers(layers)
    assert not DynamicCache(KVSpec(3, 2, 16, torch.bfloat16, CPU)).supports_in_place_layers(layers)


def test_kernel_isa_names_the_build_and_the_march_variable_picks_it(avx2_library, monkeypatch):
    assert native._declare(avx2_library).hl_kernel_isa().decode() == "avx2"
    assert native.kernel_isa() in {"avx512-vnni", "avx2-vnni", "avx2"}  # -march=native on an AVX2 machine
    monkeypatch.setenv(build.MARCH_ENV, "x86-64-v3")
    assert "-march=x86-64-v3" in build.default_flags() and "-march=native" not in build.default_flags()
    monkeypatch.setenv(build.MARCH_ENV, "x86-64-v3; rm -rf /")
    with pytest.raises(build.KernelBuildError, match="is not an architecture name"):
        build.default_flags()
    monkeypatch.setenv(build.MARCH_ENV, "no-such-cpu")
    with pytest.raises(build.KernelBuildError) as error:
        build.build_library()
    assert "compiling decode.cpp failed" in str(error.value) and "\n" not in str(error.value)


def test_an_unwritable_kernel_cache_is_one_line(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HYBRIDLLM_KERNEL_CACHE", str(blocker / "kernels"))  # a folder inside a file
    with pytest.raises(build.KernelBuildError, match="cannot write the kernel cache"):
        build.build_library()


def test_a_second_build_describes_the_current_weights(tiny_models):
    model = _load(tiny_models, "llama")
    assert _runner(model, "native").report.build.whole_step
    model.model.layers[1].self_attn.o_proj = _Bf16Linear(model.model.layers[1].self_attn.o_proj)
    runner = _runner(model, "native")
    assert not runner.report.build.whole_step and runner.backend.steps.whole is None  # no stale whole-model step
    assert sorted(runner.backend.steps.layers) == [0]
