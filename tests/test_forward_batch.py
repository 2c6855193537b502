"""One backend entry point, ``step(batch)``: rows of any length in one call, each row's logits and
KV those of its forward alone (every registered backend), every position's logits where a row
asks, and the rows' positions checked. No wall-time assertions."""

from __future__ import annotations

import pytest
import torch

from hybridllm.kvcache import DynamicCache, KVSpec, MemoryLedger
from hybridllm.kvcache.batch import BatchedCaches
from hybridllm.loading.loader import load_model
from hybridllm.loading.registry import open_checkpoint
from hybridllm.placement.apply import TierDevices
from hybridllm.placement.placement import Placement
from hybridllm.runtime.backends import BACKENDS
from hybridllm.runtime.forward_batch import ForwardBatch, ForwardRow
from hybridllm.runtime.runner import build_runner

from conftest import NEEDS_COMPILER

CPU = torch.device("cpu")
LENGTHS = (1, 5, 64)  # this step's tokens of each of three sequences
HISTORY = (40, 0, 7)  # tokens each sequence's cache already holds


def _runner(tiny_models, backend: str):
    model = load_model(open_checkpoint(tiny_models["llama"][0]), torch.float32, lambda n: CPU)
    return build_runner(model, Placement.all_on_device(model.config.n_layers), TierDevices(CPU), backend)


def _cache(runner):
    c = runner.config
    spec = KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, CPU, max_tokens=c.max_position_embeddings)
    own = runner.backend.new_cache(spec, MemoryLedger({"device": None, "host": None}))  # cuda-graph: a pool row
    return own if own is not None else DynamicCache(spec, page_size=16)


def _prefilled(runner, pasts: list[list[int]]) -> list:
    caches = []
    for past in pasts:
        cache = _cache(runner)
        if past:
            runner.step(ForwardBatch([ForwardRow(cache, past, 0)]))
        caches.append(cache)
    return caches


def _layer_kv(cache, n_layers: int) -> list[torch.Tensor]:
    return [t.clone() for layer in range(n_layers) for t in cache.read_layer(layer)]


@pytest.mark.parametrize("all_logits", [False, True], ids=["last", "every"])
@pytest.mark.parametrize("backend", [pytest.param(name, marks=NEEDS_COMPILER) if name == "native" else name
                                     for name in sorted(BACKENDS)])
def test_rows_of_one_five_and_sixty_four_tokens_in_one_step_equal_each_alone(tiny_models, backend, all_logits):
    runner = _runner(tiny_models, backend)
    gen = torch.Generator().manual_seed(3)
    vocab = runner.config.vocab_size
    pasts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in HISTORY]
    tokens = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENGTHS]
    with torch.inference_mode():
        alone_caches = _prefilled(runner, pasts)
        alone = [runner.step(ForwardBatch([ForwardRow(cache, ids, cache.seq_length, all_logits)]))[0]
                 for cache, ids in zip(alone_caches, tokens)]
        caches = _prefilled(runner, pasts)
        together = runner.step(ForwardBatch([ForwardRow(cache, ids, cache.seq_length, all_logits)
                                             for cache, ids in zip(caches, tokens)]))
    assert len(together) == 3
    for n, a, b in zip(LENGTHS, alone, together):
        assert b.shape == ((n if all_logits else 1), vocab)
        if backend == "cuda-graph" and n == 1:  # the static step runs a bucket of pool rows: not batch-invariant
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(a, b), f"the row of {n} tokens"
    for n, past, a, b in zip(LENGTHS, HISTORY, alone_caches, caches):
        assert a.seq_length == b.seq_length == past + n
        for x, y in zip(_layer_kv(a, runner.config.n_layers), _layer_kv(b, runner.config.n_layers)):
            if backend == "cuda-graph":
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
            else:
                assert torch.equal(x, y)
    for cache in alone_caches + caches:
        cache.reset()


@pytest.mark.parametrize("backend", ["eager", pytest.param("native", marks=NEEDS_COMPILER)])
def test_every_position_of_a_row_equals_the_row_fed_one_token_at_a_time(tiny_models, backend):
    """A row's all_logits are its positions' next-token logits: what k + 1 one-token steps give
    (speculative decoding verifies drafts from them)."""
    runner = _runner(tiny_models, backend)
    ids = list(range(3, 3 + 12))
    with torch.inference_mode():
        whole, stepped = _cache(runner), _cache(runner)
        runner.step(ForwardBatch([ForwardRow(whole, ids[:8], 0)]))
        runner.step(ForwardBatch([ForwardRow(stepped, ids[:8], 0)]))
        every = runner.step(ForwardBatch([ForwardRow(whole, ids[8:], 8, all_logits=True)]))[0]  # (4, vocab)
        one_by_one = torch.cat([runner.step(ForwardBatch([ForwardRow(stepped, [t], stepped.seq_length)]))[0]
                                for t in ids[8:]])  # (4, vocab)
    assert every.shape == one_by_one.shape == (4, runner.config.vocab_size)
    torch.testing.assert_close(every, one_by_one, atol=1e-4, rtol=1e-4)
    assert every.argmax(-1).tolist() == one_by_one.argmax(-1).tolist()


def test_a_row_must_start_where_its_cache_ends(tiny_models):
    runner = _runner(tiny_models, "eager")
    cache = _cache(runner)
    with pytest.raises(ValueError, match="starts at position 3 but its cache holds 0 tokens"):
        runner.step(ForwardBatch([ForwardRow(cache, [1, 2], 3)]))
    with pytest.raises(ValueError, match="at least one token"):
        ForwardRow(cache, [], 0)
    with pytest.raises(ValueError, match="at least one row"):
        ForwardBatch([])
    assert cache.seq_length == 0  # nothing ran


def test_batched_caches_truncate_each_row_to_its_own_length(tiny_models):
    runner = _runner(tiny_models, "eager")
    caches = [_cache(runner) for _ in range(3)]
    with torch.inference_mode():
        runner.step(ForwardBatch([ForwardRow(cache, list(range(1, 1 + n)), 0) for cache, n in zip(caches, (4, 9, 6))]))
    batch = BatchedCaches(caches)
    batch.truncate([2, 9, 0])  # a rejected draft's rows, none, all
    assert batch.seq_lengths == [2, 9, 0]
    both = BatchedCaches(caches[:2])
    both.truncate(1)  # one length for every row
    assert both.seq_lengths == [1, 1]
    with pytest.raises(ValueError, match="3 rows"):
        batch.truncate([1, 1])
