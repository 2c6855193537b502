"""The ``cuda-graph`` backend's static-buffer decode step and attention by phase.

On the CPU (CI) the static step runs eagerly: it must give the eager backend's greedy tokens,
alone and in a padded batch, without touching rows outside the batch. The ``cuda`` tests (a later
GPU session runs them: ``pytest -m cuda``) check graph replay against eager, greedy parity with
transformers on the GPU and that the named SDPA backends serve every phase.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybridllm.config import KVConfig, SamplingParams
from hybridllm.errors import ConfigError
from hybridllm.kvcache.attention import (
    batched_products_decode_attention,
    causal_attention,
    causal_mask,
    length_masked_decode_attention,
    lower_right_causal_attention,
    split_kv_decode_attention,
    reference_partial_attention,
    split_causal_attention,
    split_kv_attention,
)
from hybridllm.kvcache.base import KVSpec, MemoryLedger
from hybridllm.kvcache.batch import BatchedCaches
from hybridllm.kvcache.dynamic import DynamicCache
from hybridllm.loading.loader import load_model
from hybridllm.loading.registry import open_checkpoint
from hybridllm.placement.apply import TierDevices
from hybridllm.placement.placement import Placement
from hybridllm.runtime.backends.cuda_graph import BATCH_BUCKETS, DECODE_ATTENTION, batch_bucket, key_span
from hybridllm.runtime.runner import build_runner

CPU = torch.device("cpu")
PROMPT_LENGTHS = (5, 9, 13)


# ---- attention by phase -------------------------------------------------------------------------
def masked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start: int) -> torch.Tensor:
    """The former ``causal_attention``: GQA folded into the query axis, a materialized (G*T, S) mask."""
    batch, n_heads, n_queries, head_dim = q.shape
    groups = n_heads // k.shape[1]
    q_grouped = q.reshape(batch, k.shape[1], groups * n_queries, head_dim)
    mask = causal_mask(n_queries, k.shape[2], query_start, q.device).repeat(groups, 1)
    return F.scaled_dot_product_attention(q_grouped, k, v, attn_mask=mask).reshape(q.shape)


def _qkv(n_tokens: int, device: torch.device = CPU, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 8, n_tokens, 16, generator=g)
    k = torch.randn(2, 2, n_tokens, 16, generator=g)
    v = torch.randn(2, 2, n_tokens, 16, generator=g)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


@pytest.mark.parametrize("chunk", [1, 3, 8, 17, 40])
def test_chunked_prefill_without_a_mask_equals_the_masked_result(chunk):
    q, k, v = _qkv(40)
    expected = masked_reference(q, k, v, 0)
    outs = []
    for start in range(0, 40, chunk):
        end = min(40, start + chunk)
        outs.append(causal_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end], query_start=start))
    torch.testing.assert_close(torch.cat(outs, dim=2), expected, atol=2e-6, rtol=1e-5)


def test_the_split_and_lower_right_forms_equal_the_mask():
    q, k, v = _qkv(24)
    new = q[:, :, 16:]  # a chunk of 8 at positions 16..23 over 24 keys
    expected = masked_reference(new, k, v, 16)
    torch.testing.assert_close(split_causal_attention(new, k, v, 16), expected, atol=2e-6, rtol=1e-5)
    # the CUDA path's mask-free form (on the CPU PyTorch materializes it; the result must agree)
    torch.testing.assert_close(lower_right_causal_attention(new, k, v), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 16, 64])
def test_split_kv_decode_equals_the_unsplit_attention(chunk_tokens):
    q, k, v = _qkv(37)
    out, lse = split_kv_attention(q[:, :, :1], k, v, chunk_tokens)
    ref_out, ref_lse = reference_partial_attention(q[:, :, :1], k, v)
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError):
        split_kv_attention(q[:, :, :1], k, v, 0)


def test_length_masked_decode_sees_each_rows_own_keys():
    q, k, v = _qkv(20)
    lengths = torch.tensor([7, 20])
    out = length_masked_decode_attention(q[:, :, :1], k, v, lengths)
    for row, length in enumerate(lengths.tolist()):
        expected = causal_attention(q[row:row + 1, :, :1], k[row:row + 1, :, :length], v[row:row + 1, :, :length],
                                    query_start=length - 1)
        torch.testing.assert_close(out[row:row + 1], expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk_tokens", [64, 128])
def test_split_static_decode_equals_the_masked_sdpa(chunk_tokens):
    q, k, v = _qkv(256)
    lengths = torch.tensor([1, 200])  # a row that sees one key (whole chunks past its length)
    torch.testing.assert_close(split_kv_decode_attention(q[:, :, :1], k, v, lengths, chunk_tokens),
                               length_masked_decode_attention(q[:, :, :1], k, v, lengths), atol=2e-6, rtol=1e-5)


def test_the_two_products_form_equals_the_masked_sdpa_over_a_span_of_the_buffer():
    q, k, v = _qkv(256)
    buffer_k, buffer_v = torch.zeros(2, k.shape[1], 320, k.shape[3]), torch.zeros(2, v.shape[1], 320, v.shape[3])
    buffer_k[:, :, :256], buffer_v[:, :, :256] = k, v
    span_k, span_v = buffer_k[:, :, :256], buffer_v[:, :, :256]  # a strided view, as the graph step reads the pool
    lengths = torch.tensor([1, 200])
    torch.testing.assert_close(batched_products_decode_attention(q[:, :, :1], span_k, span_v, lengths),
                               length_masked_decode_attention(q[:, :, :1], k, v, lengths), atol=2e-6, rtol=1e-5)


def test_buckets_and_spans():
    assert BATCH_BUCKETS == (1, 2, 4, 8, 16, 32, 64)
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 33, 64, 65)] == [1, 2, 4, 4, 8, 64, 64, None]
    assert key_span(10, 4096) == 256 and key_span(257, 4096) == 512 and key_span(3000, 2048) == 2048


# ---- the static-buffer decode step on the CPU ----------------------------------------------------
def _model(tiny_models, arch: str = "llama3", device: torch.device = CPU, dtype: torch.dtype = torch.float32):
    return _model_from_folder(tiny_models[arch][0], device, dtype)


def _model_from_folder(folder: Path, device: torch.device = CPU, dtype: torch.dtype = torch.float32):
    return load_model(open_checkpoint(folder), dtype, lambda name: device)


def _spec(config, device: torch.device = CPU, dtype: torch.dtype = torch.float32) -> KVSpec:
    return KVSpec(config.n_layers, config.n_kv_heads, config.head_dim, dtype, device,
                  max_tokens=config.max_position_embeddings)


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _eager_greedy(model, prompt: list[int], steps: int, device: torch.device = CPU) -> list[int]:
    runner = build_runner(model, Placement.all_on_device(model.config.n_layers), TierDevices(device), "eager")
    cache = DynamicCache(_spec(model.config, device, model.compute_dtype), page_size=16)
    with torch.inference_mode():
        logits = runner(torch.tensor([prompt]), cache, 0)
        tokens = [int(logits[0, -1].argmax())]
        for _ in range(steps - 1):
            logits = runner(torch.tensor([tokens[-1:]]), cache, cache.seq_length)
            tokens.append(int(logits[0, -1].argmax()))
    return tokens


def _static_greedy(model, prompts: list[list[int]], steps: int, device: torch.device = CPU,
                   bystander: list[int] | None = None, attention: str | None = None, fused: bool | None = None,
                   lookahead: bool | None = None, step_tokens: int | None = None):
    """Greedy tokens of ``prompts`` decoded as one batch through the cuda-graph backend; a
    ``bystander`` prompt is prefilled into a row inside the bucket but never decoded;
    ``attention`` narrows the static attention to one form; ``fused`` switches the fused
    elementwise kernels on or off, ``lookahead`` the step launched ahead; ``step_tokens`` sets the
    longest row that goes through the static step token by token (None: the backend's choice)."""
    runner = build_runner(model, Placement.all_on_device(model.config.n_layers), TierDevices(device), "cuda-graph")
    backend = runner.backend
    if attention is not None:
        backend.attention_variants = (attention,)
    if fused is not None:
        backend.fused_elementwise = fused
    if lookahead is not None:
        backend.lookahead = lookahead
    if step_tokens is not None:
        backend.step_tokens_max = step_tokens
    ledger = MemoryLedger()
    spec = _spec(model.config, device, model.compute_dtype)
    caches = [backend.new_cache(spec, ledger) for _ in prompts]
    with torch.inference_mode():
        firsts = [int(runner(torch.tensor([p]), c, 0)[0, -1].argmax()) for p, c in zip(prompts, caches)]
        side = None
        if bystander is not None:
            side = backend.new_cache(spec, ledger)
            runner(torch.tensor([bystander]), side, 0)
        before = [tuple(t.clone() for t in side.read_layer(i)) for i in range(spec.n_layers)] if side else None
        tokens = [[t] for t in firsts]
        batch = BatchedCaches(caches)
        for _ in range(steps - 1):
            ids = torch.tensor([[row[-1]] for row in tokens])  # (B, 1)
            logits = runner(ids, batch, batch.start_positions())  # (B, 1, vocab)
            for row, out in zip(tokens, logits):
                row.append(int(out[-1].argmax()))
    if side is not None:
        for layer_idx, (keys, values) in enumerate(before):
            now_keys, now_values = side.read_layer(layer_idx)
            assert torch.equal(now_keys, keys) and torch.equal(now_values, values)
    return tokens, backend


def test_static_step_alone_gives_the_eager_tokens(tiny_models):
    model = _model(tiny_models)
    prompt = _prompts(model.config.vocab_size)[1]
    tokens, backend = _static_greedy(model, [prompt], steps=10)
    assert tokens[0] == _eager_greedy(model, prompt, steps=10)
    assert backend.steps_by_bucket == {1: 9}  # every decode step ran the static step, bucket 1


@pytest.mark.parametrize("arch, attention, lookahead", [("llama3", "sdpa", False), ("qwen3", "sdpa", False),
                                                       ("llama3", "split", False), ("llama3", "gemm", False),
                                                       ("llama3", "sdpa", True), ("qwen3", "sdpa", True)])
def test_a_batch_of_three_padded_to_four_gives_each_rows_eager_tokens(tiny_models, arch, attention, lookahead):
    model = _model(tiny_models, arch)
    prompts = _prompts(model.config.vocab_size)
    bystander = prompts[0][:3]  # a sequence in the fourth row of the bucket, never in the batch
    tokens, backend = _static_greedy(model, prompts, steps=8, bystander=bystander, attention=attention,
                                     lookahead=lookahead)
    assert tokens == [_eager_greedy(model, p, steps=8) for p in prompts]
    policy = backend.lookahead_policy
    assert (policy.hits, policy.misses) == ((6, 0) if lookahead else (0, 0))  # 7 decode steps: every one after the first
    assert backend.steps_by_bucket == {4: 7}


@pytest.mark.parametrize("device", [CPU, pytest.param(torch.device("cuda"), marks=pytest.mark.cuda)], ids=str)
@pytest.mark.parametrize("lookahead", [False, True])
def test_short_prompts_go_token_by_token_through_the_static_step(tiny_models, lookahead, device):
    """Prompts of at most ``step_tokens_max`` tokens (here 5, 9 and 13, and a 3-token bystander)
    prefill through the static step, one token of every prompt per step, instead of a walk each;
    the greedy tokens are the eager backend's and the bystander's KV is untouched by the decode."""
    model = _model(tiny_models, device=device)
    prompts = _prompts(model.config.vocab_size)
    tokens, backend = _static_greedy(model, prompts, steps=8, device=device, bystander=prompts[0][:3],
                                     lookahead=lookahead, step_tokens=16)
    assert tokens == [_eager_greedy(model, p, steps=8, device=device) for p in prompts]
    # each prompt its own prefill call (5, 9, 13 and 3 steps in buckets 1, 2, 4 and 4), then 7 decode steps
    assert backend.steps_by_bucket == {1: 5, 2: 9, 4: 13 + 3 + 7}


def test_a_row_of_several_tokens_wanting_every_logit_gets_them_from_the_steps(tiny_models):
    model = _model(tiny_models)
    prompt = _prompts(model.config.vocab_size)[2]  # 13 tokens
    logits = {}
    for step_tokens in (1, 16):  # the walk, then the static step token by token
        runner = build_runner(model, Placement.all_on_device(model.config.n_layers), TierDevices(CPU), "cuda-graph")
        runner.backend.step_tokens_max = step_tokens
        cache = runner.backend.new_cache(_spec(model.config), MemoryLedger())
        with torch.inference_mode():
            logits[step_tokens] = runner(torch.tensor([prompt]), cache, 0, all_logits=True)  # (1, 13, vocab)
        assert cache.seq_length == 13
    assert logits[16].shape == logits[1].shape == (1, 13, model.config.vocab_size)
    torch.testing.assert_close(logits[16], logits[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", [CPU, pytest.param(torch.device("cuda"), marks=pytest.mark.cuda)], ids=str)
@pytest.mark.parametrize("choose", ["greedy", "second best"])
def test_the_step_launched_ahead_changes_no_logit(tiny_models, choose, device):
    """The step launched ahead on the greedy guess (on the CPU at once, on CUDA on a side stream
    while the host goes on): where the token chosen is the guess its logits are taken, else they
    are dropped and the guesses back off; either way every step's logits equal those without it,
    bit for bit, also when a prompt grows the pool between two steps."""
    model = _model(tiny_models, device=device)
    prompts = _prompts(model.config.vocab_size)

    def decode(lookahead: bool):
        runner = build_runner(model, Placement.all_on_device(model.config.n_layers), TierDevices(device), "cuda-graph")
        backend = runner.backend
        assert backend.captures == (device.type == "cuda")
        backend.lookahead = lookahead
        spec, ledger = _spec(model.config, device), MemoryLedger()
        caches = [backend.new_cache(spec, ledger) for _ in prompts[:2]]
        seen = []
        with torch.inference_mode():
            last = [runner(torch.tensor([p]), c, 0)[0, -1] for p, c in zip(prompts, caches)]
            batch = BatchedCaches(caches)
            for step in range(12):
                if step == 5:  # another sequence's prompt, into the third row, between two steps
                    runner(torch.tensor([prompts[2]]), backend.new_cache(spec, ledger), 0)
                ranked = [row.topk(2).indices for row in last]
                ids = torch.tensor([[int(r[0] if choose == "greedy" else r[1])] for r in ranked])  # (B, 1)
                logits = runner(ids, batch, batch.start_positions())  # (B, 1, vocab)
                seen.append(logits.clone())
                last = [row[-1] for row in logits]
        return seen, backend.lookahead_policy

    plain, _ = decode(False)
    ahead, policy = decode(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, ahead))
    if choose == "greedy":  # every step after the first, but the one after the prompt grew the pool (2 -> 4 rows)
        assert (policy.hits, policy.misses) == (10, 0)
    else:  # guesses at steps 0, 2, 5 and 10 miss at steps 1, 3, 6 and 11 (each miss skips 1, 2, 4, 8 steps)
        assert (policy.hits, policy.misses) == (0, 4)


def test_the_guess_s_two_pass_argmax_is_torch_s():
    from hybridllm.runtime.backends.lookahead import argmax_rows

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 128256, generator=g)
    scores[1, 77] = scores[1, 128255] = 9.0  # a tie across parts: the first index
    scores[2, 5000] = scores[2, 5001] = 9.0  # a tie inside a part
    scores[3] = 1.0  # all equal
    assert torch.equal(argmax_rows(scores), scores.argmax(dim=-1))
    odd = torch.randn(3, 1031, generator=g)  # no part count divides it: one pass
    assert torch.equal(argmax_rows(odd), odd.argmax(dim=-1))


def test_the_pool_grows_past_its_first_capacity(tiny_models):
    model = _model(tiny_models)
    prompt = _prompts(model.config.vocab_size)[2]
    tokens, backend = _static_greedy(model, [prompt], steps=140)  # 13 + 140 tokens: past one 128-token page
    assert backend.pool.capacity >= 13 + 140 and backend.pool.generation >= 2
    assert tokens[0] == _eager_greedy(model, prompt, steps=140)


def test_llm_generate_with_cuda_graph_equals_eager(tiny_models):
    from hybridllm import LLM

    path = tiny_models["llama3"][0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = _prompts(320)
    static, eager = LLM(path, device="cpu", decode_backend="cuda-graph"), LLM(path, device="cpu",
                                                                              decode_backend="eager")
    assert static.runner.report.backend == "cuda-graph"
    static_ids = [r.token_ids for r in static.engine.generate_batch(prompts, [params] * 3)]
    eager_ids = [r.token_ids for r in eager.engine.generate_batch(prompts, [params] * 3)]
    assert static_ids == eager_ids
    backend = static.runtime.runner.backend
    assert backend.steps_by_bucket[4] > 0  # the loop's batch of three went through bucket 4
    assert static.engine.scheduler.ledger.current("device") == 0  # every row given back
    assert backend.pool.rows >= 3 and backend.pool.held_rows() == 0

    forked = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2)  # n: copies of the prompt's row
    static_forks = [r.token_ids for r in static.generate_all(prompts[0], forked)]
    assert static_forks == [r.token_ids for r in eager.generate_all(prompts[0], forked)]
    assert static_forks[0] == static_forks[1]


@pytest.mark.parametrize("placement, words", [
    (Placement(["device", "host"], embed_tier="device", head_tier="host"), "on the device"),
    (Placement(["device", "device"], kv=KVConfig(kv_cache="tiered")), "dense KV"),
    (Placement(["device", "device"], decode_on="host"), "decoding on the device"),
])
def test_placements_it_cannot_serve_are_one_line_config_errors(tiny_models, placement, words):
    model = _model(tiny_models)
    with pytest.raises(ConfigError, match=words):
        build_runner(model, placement, TierDevices(CPU), "cuda-graph")


# ---- on a GPU (pytest -m cuda) -------------------------------------------------------------------
CUDA = torch.device("cuda")


@pytest.mark.slow
def test_the_triton_form_runs_in_triton_s_interpreter(tiny_models):
    """The Triton kernels on CPU tensors (``TRITON_INTERPRET=1``, in a process of its own): the
    kernels against the PyTorch ops they replace, then tiny Llama-3, Qwen2 (QKV bias) and Phi-3
    (partial rotary) models' greedy tokens through the static step with the Triton attention and
    the fused kernels equal the eager backend's (``tests/triton_interpreted.py``)."""
    pytest.importorskip("triton")
    script = Path(__file__).with_name("triton_interpreted.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    folders = [str(tiny_models[arch][0]) for arch in ("llama3", "qwen2", "phi3_partial")]  # QKV bias, partial rotary
    done = subprocess.run([sys.executable, str(script), *folders], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("kernel ") == 5 and done.stdout.count("static step (") == 6, done.stdout
    assert done.stdout.count("rotate_and_store ") == 12 and done.stdout.rstrip().endswith("ok"), done.stdout


def test_the_triton_form_is_tried_only_where_it_runs(tiny_models, monkeypatch):
    from hybridllm.runtime.backends.cuda_graph import triton_runs_on

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_runs_on(CPU)  # the CPU runs the first form; Triton needs a GPU or its interpreter
    model = _model(tiny_models)
    runner = build_runner(model, Placement.all_on_device(model.config.n_layers), TierDevices(CPU), "cuda-graph")
    assert runner.backend._variants(256) == ["sdpa", "split", "gemm"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    has_triton = triton_runs_on(CPU)
    runner = build_runner(model, Placement.all_on_device(model.config.n_layers), TierDevices(CPU), "cuda-graph")
    assert runner.backend._variants(256) == ["sdpa", "split", "gemm"] + ["triton", "triton-coarse"] * has_triton


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("span, lengths", [(4096, [4000]), (32768, [30000, 17, 32768])])
def test_the_triton_decode_kernels_equal_the_masked_sdpa_on_cuda(dtype, span, lengths):
    from hybridllm.kvcache.triton_decode import triton_decode_attention

    g = torch.Generator().manual_seed(span)
    rows = len(lengths)
    pool_k = torch.randn(rows + 1, 8, span + 1, 64, generator=g).to(CUDA, dtype)
    pool_v = torch.randn(rows + 1, 8, span + 1, 64, generator=g).to(CUDA, dtype)
    q = torch.randn(rows, 32, 1, 64, generator=g).to(CUDA, dtype)
    visible = torch.tensor(lengths, device=CUDA)
    keys, values = pool_k[:rows, :, :span], pool_v[:rows, :, :span]
    out = triton_decode_attention(q, keys, values, visible)
    ref = length_masked_decode_attention(q.float(), keys.float(), values.float(), visible)
    assert out.dtype == dtype and out.shape == q.shape
    exact = dtype == torch.float32  # else the output's rounding (half a unit: 2^-9 in bfloat16)
    torch.testing.assert_close(out.float(), ref, atol=1e-5 if exact else 1e-3, rtol=1e-5 if exact else 2 ** -8)


@pytest.mark.cuda
def test_the_fused_elementwise_kernels_round_as_pytorch_does_on_cuda():
    """On a GPU (rounding to nearest) the fused kernels are PyTorch's bfloat16 ops to within one
    unit of the last place (rsqrt's and exp's own last bits)."""
    from hybridllm.models.layers import RMSNorm, apply_rotary
    from hybridllm.models.triton_fused import rms_norm, rotate_and_store, silu_and_mul

    g = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16
    x, residual = (torch.randn(4, 1, 2048, generator=g).to(CUDA, dtype) for _ in range(2))
    norm = RMSNorm(2048, 1e-5).to(CUDA, dtype)
    norm.weight.data = (1 + torch.randn(2048, generator=g) / 4).to(CUDA, dtype)
    one_unit = {"rtol": 2 ** -7, "atol": 1e-6}
    with torch.no_grad():
        normed, summed = rms_norm(x, norm, residual)
        assert torch.equal(summed, x + residual)
        torch.testing.assert_close(normed, norm(summed), **one_unit)
        gate_up = torch.randn(4, 1, 2 * 8192, generator=g).to(CUDA, dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up, **one_unit)
        qkv = torch.randn(4, 1, 48 * 64, generator=g).to(CUDA, dtype)  # 32 q heads, 8 k, 8 v
        angles = torch.arange(100.0)[:, None] / (500000.0 ** (torch.arange(32) / 32))  # (positions, 32)
        cos, sin = (torch.cat((a, a), dim=-1).to(CUDA, dtype) for a in (angles.cos(), angles.sin()))
        positions, slots, columns = (torch.tensor(v, device=CUDA) for v in ([3, 50, 99, 0], [1, 0, 3, 2], [3, 50, 99, 0]))
        keys = torch.zeros(4, 8, 128, 64, device=CUDA, dtype=dtype)
        values = torch.zeros_like(keys)
        q = rotate_and_store(qkv, cos, sin, positions, slots, columns, keys, values, 32, 8)
        heads = qkv.view(4, 48, 1, 64)
        rotated = apply_rotary(heads[:, :40], cos[positions][:, None, None, :], sin[positions][:, None, None, :])
        # not bit for bit (the first H200 run): within a unit of the products' own size (values ~N(0, 1))
        products = {"rtol": 2 ** -7, "atol": 2 ** -6}
        torch.testing.assert_close(q, rotated[:, :32], **products)
        torch.testing.assert_close(keys[slots, :, columns], rotated[:, 32:, 0], **products)
        assert torch.equal(values[slots, :, columns], heads[:, 40:, 0])


@pytest.mark.cuda
@pytest.mark.parametrize("attention", [None, "sdpa", "split", "gemm", "triton", "triton-coarse"])  # None: the fastest, timed
@pytest.mark.parametrize("n_rows, bucket", [(1, 1), (3, 4)])
def test_graph_replay_equals_eager_token_for_token(tiny_models, n_rows, bucket, attention):
    model = _model(tiny_models, device=CUDA, dtype=torch.float32)
    prompts = _prompts(model.config.vocab_size)[:n_rows]
    bystander = prompts[0][:3] if n_rows > 1 else None  # in the fourth row of bucket 4: must stay untouched
    tokens, backend = _static_greedy(model, prompts, steps=12, device=CUDA, bystander=bystander, attention=attention,
                                     step_tokens=1)  # prompts walk the layers: every static step is a decode step
    assert backend.captures and backend.captured_keys  # the steps were replayed from captured graphs
    assert all(set(timings) <= set(DECODE_ATTENTION) for timings in backend.attention_choice.values())
    assert {key[0] for key in backend.captured_keys} == {bucket}
    assert tokens == [_eager_greedy(model, p, steps=12, device=CUDA) for p in prompts]
    assert backend.steps_by_bucket == {bucket: 11}
    assert backend.lookahead and (backend.lookahead_policy.hits, backend.lookahead_policy.misses) == (10, 0)


@pytest.mark.cuda
def test_the_two_products_form_copies_no_keys_on_cuda():
    """The point of the form: a span shorter than the pool's capacity is read in place (the split
    form's chunked view is copied each step: the second H100 run's strided copies)."""
    from torch.profiler import ProfilerActivity, profile

    pool_k = torch.randn(4, 8, 8192, 64, device=CUDA, dtype=torch.bfloat16)
    pool_v = torch.randn_like(pool_k)
    q = torch.randn(1, 32, 1, 64, device=CUDA, dtype=torch.bfloat16)
    lengths = torch.tensor([3000], device=CUDA)
    batched_products_decode_attention(q, pool_k[:1, :, :4096], pool_v[:1, :, :4096], lengths)  # cuBLAS set up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        batched_products_decode_attention(q, pool_k[:1, :, :4096], pool_v[:1, :, :4096], lengths)
    names = {event.key for event in prof.key_averages()}
    assert not names & {"aten::clone", "aten::contiguous"}, sorted(names)


@pytest.mark.cuda
def test_graphs_are_captured_again_after_the_pool_grows(tiny_models):
    # The first H100 run: prefill grew the pool after the warm-up's capture, the old graphs were
    # dropped, and the next capture into their memory pool failed PyTorch's use-count assertion.
    model = _model(tiny_models, device=CUDA, dtype=torch.float32)
    prompt = _prompts(model.config.vocab_size)[2]
    tokens, backend = _static_greedy(model, [prompt], steps=140, device=CUDA)  # past one 128-token page
    assert backend.pool.generation >= 2 and backend.captured_keys
    assert tokens[0] == _eager_greedy(model, prompt, steps=140, device=CUDA)


@pytest.mark.cuda
@pytest.mark.parametrize("backend_name", ["eager", "cuda-graph"])
def test_greedy_parity_with_transformers_on_the_gpu(tiny_models, backend_name):
    from hybridllm import LLM

    import copy

    folder, _, hf_model = tiny_models["llama3"]
    prompt = _prompts(320)[2]
    hf = copy.deepcopy(hf_model).to(CUDA).eval()  # the session's CPU model stays as it is
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt], device=CUDA), max_new_tokens=16, min_new_tokens=16,
                               do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(folder, device="cuda", decode_backend=backend_name, prefill_chunk=5)  # chunks: lower-right causal
    result = llm.engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert result.token_ids == expected


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sdpa_backend_choice_serves_every_phase(dtype):
    q, k, v = _qkv(48, CUDA, dtype)
    tolerance = dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)
    full = masked_reference(q.float(), k.float(), v.float(), 0)
    torch.testing.assert_close(causal_attention(q, k, v, 0).float(), full, **tolerance)  # prefill, no past
    chunk = causal_attention(q[:, :, 32:], k, v, 32)  # chunked prefill: lower-right causal
    torch.testing.assert_close(chunk.float(), full[:, :, 32:], **tolerance)
    step = causal_attention(q[:, :, 47:], k, v, 47)  # decode: one query, no mask
    torch.testing.assert_close(step.float(), full[:, :, 47:], **tolerance)
    lengths = torch.tensor([48, 20], device=CUDA)
    masked = length_masked_decode_attention(q[:, :, :1], k, v, lengths)
    assert torch.isfinite(masked).all()
