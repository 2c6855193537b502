"""Batched native decode is batch-invariant: each sequence's logits are bitwise the same decoded
alone or inside a batch (any size, any position in it, any thread count), so greedy decoding
gives the same tokens alone and under load; and a batch really decodes natively in one call.
No wall-time assertions (throughput is the benchmark's: docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from hybridllm import LLM, SamplingParams
from hybridllm.engine.scheduler import Scheduler, SeqEvent
from hybridllm.kernels import native
from hybridllm.kvcache import DynamicCache, KVSpec
from hybridllm.kvcache.batch import BatchedCaches
from hybridllm.loading.loader import load_model
from hybridllm.loading.registry import open_checkpoint
from hybridllm.models.quantized import quantize_model
from hybridllm.placement.apply import TierDevices
from hybridllm.placement.placement import Placement
from hybridllm.runtime.runner import build_runner

from conftest import NEEDS_COMPILER

CPU = torch.device("cpu")

pytestmark = NEEDS_COMPILER

PROMPT_LENGTHS = (3, 17, 70, 9, 130)  # rows at different positions: one or several attention chunks


def _runner(tiny_models, weights: str):
    model = load_model(open_checkpoint(tiny_models["llama"][0]), torch.float32, lambda n: CPU)
    if weights != "float":
        quantize_model(model, weights)
    runner = build_runner(model, Placement.all_on_device(model.config.n_layers), TierDevices(CPU), "native")
    assert runner.report.build.whole_step
    return runner


def _prefilled(runner, lengths) -> tuple[list[DynamicCache], list[int]]:
    """One cache per prompt (seeded random ids), prefilled; each prompt's greedy next token."""
    c = runner.config
    caches, tokens = [], []
    for i, length in enumerate(lengths):
        cache = DynamicCache(KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, CPU,
                                    max_tokens=c.max_position_embeddings), page_size=16)
        ids = torch.randint(0, c.vocab_size, (1, length), generator=torch.Generator().manual_seed(i))
        with torch.inference_mode():
            tokens.append(int(runner(ids, cache, 0)[0, -1].argmax()))
        caches.append(cache)
    return caches, tokens


def _decode_alone(runner, lengths, steps: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Each prompt decoded on its own: logits (rows, steps, vocab) and the greedy tokens fed."""
    caches, first = _prefilled(runner, lengths)
    logits, fed = [], []
    with torch.inference_mode():
        for cache, token in zip(caches, first):
            row, tokens = [], []
            for _ in range(steps):
                tokens.append(token)
                out = runner(torch.tensor([[token]]), cache, cache.seq_length)[0, -1]
                row.append(out)
                token = int(out.argmax())
            logits.append(torch.stack(row))
            fed.append(tokens)
    return torch.stack(logits), fed


def _decode_together(runner, lengths, fed: list[list[int]], order: list[int]) -> torch.Tensor:
    """The same prompts as one batch (rows in ``order``), fed the same tokens: logits (rows, steps, vocab)
    in the prompts' own order."""
    caches, _ = _prefilled(runner, lengths)
    batch = BatchedCaches([caches[i] for i in order])
    steps = len(fed[0])
    out = torch.empty(len(lengths), steps, runner.config.vocab_size)
    with torch.inference_mode():
        for step in range(steps):
            ids = torch.tensor([[fed[i][step]] for i in order])  # (B, 1)
            logits = runner(ids, batch, batch.start_positions())  # (B, 1, vocab)
            for row, i in enumerate(order):
                out[i, step] = logits[row, -1]
    return out


def _count_rows(monkeypatch) -> list[int]:
    """The batch size of every native whole-step call."""
    rows: list[int] = []
    decode = native.NativeModel.decode

    def counting(self, x, *args):
        rows.append(x.shape[0])
        return decode(self, x, *args)

    monkeypatch.setattr(native.NativeModel, "decode", counting)
    return rows


@pytest.mark.parametrize("weights", ["float", "int4", "int8"])
def test_a_batch_decodes_natively_with_each_rows_logits_bitwise_equal_to_alone(tiny_models, weights, monkeypatch):
    runner = _runner(tiny_models, weights)
    steps = 6
    alone, fed = _decode_alone(runner, PROMPT_LENGTHS, steps)
    rows = _count_rows(monkeypatch)
    n = len(PROMPT_LENGTHS)
    for order in (list(range(n)), list(reversed(range(n))), [2, 0]):  # any position, any batch size
        together = _decode_together(runner, PROMPT_LENGTHS, fed, order)
        for i in order:
            assert torch.equal(together[i], alone[i]), f"row {i} differs inside the batch {order}"
    assert rows == [n] * steps + [n] * steps + [2] * steps  # one native call per batch step


def test_a_batch_of_one_through_the_batched_entry_equals_the_single_path(tiny_models):
    runner = _runner(tiny_models, "int4")
    ([single], [token]), ([batched], _) = _prefilled(runner, (40,)), _prefilled(runner, (40,))
    with torch.inference_mode():
        for _ in range(4):
            a = runner(torch.tensor([[token]]), single, single.seq_length)
            wrapped = BatchedCaches([batched])
            b = runner(torch.tensor([[token]]), wrapped, wrapped.start_positions())
            assert torch.equal(a, b)
            token = int(a[0, -1].argmax())


def test_logits_do_not_depend_on_the_thread_count(tiny_models):
    """The work split depends on the sizes only, so the thread count picked at run time (a busy
    machine gets fewer threads) never changes an answer."""
    runner = _runner(tiny_models, "int4")
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 3):
            torch.set_num_threads(count)
            results.append(_decode_alone(runner, (5, 150), steps=3)[0])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


# ---- through the request loop -------------------------------------------------------------------
def _generate(scheduler: Scheduler, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Submit every prompt at once, run the loop until idle; each request's token ids."""
    last: dict[str, SeqEvent] = {}
    for i, prompt in enumerate(prompts):
        scheduler.submit(f"r{i}", prompt, params, lambda event, key=f"r{i}": last.__setitem__(key, event))
    scheduler.run_until_idle()
    assert all(last[f"r{i}"].finish_reason == "length" for i in range(len(prompts)))
    return [last[f"r{i}"].token_ids for i in range(len(prompts))]


def _alone_and_together(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list, list, Scheduler]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    alone = [_generate(Scheduler(llm.runtime, max_batch=1), [prompt], params)[0] for prompt in prompts]
    scheduler = Scheduler(llm.runtime, max_batch=len(prompts))
    together = _generate(scheduler, prompts, params)
    return alone, together, scheduler


def test_greedy_requests_give_the_same_tokens_alone_and_in_one_batch(tiny_models, monkeypatch):
    llm = LLM(str(tiny_models["llama"][1]), threads=2)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, llm.config.vocab_size, (n,), generator=generator).tolist() for n in (4, 33, 12, 70, 8)]
    rows = _count_rows(monkeypatch)
    alone, together, scheduler = _alone_and_together(llm, prompts, max_tokens=12)
    assert together == alone
    assert max(scheduler.decode_batch_sizes) == len(prompts)  # they did decode as one batch
    assert max(rows) == len(prompts)  # natively


@pytest.mark.slow
def test_default_model_16_greedy_prompts_alone_and_in_one_batch(shared_llm):
    llm = shared_llm(threads=2)
    assert llm.runner.report.build.whole_step
    topics = ["the sea", "a city at night", "bread", "mountains", "a library", "winter", "trains", "the moon",
              "gardens", "a storm", "music", "coffee", "rivers", "a market", "clocks", "birds"]
    prompts = [llm.encode_prompt([{"role": "user", "content": f"Write a short paragraph about {topic}."}])
               for topic in topics]
    alone, together, scheduler = _alone_and_together(llm, prompts, max_tokens=48)
    differing = [i for i in range(len(prompts)) if alone[i] != together[i]]
    assert differing == []
    assert max(scheduler.decode_batch_sizes) == len(prompts)


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("kind", ["int4", "int8_groups"])
def test_quantized_kernels_give_the_same_bits_on_256_and_512_bit_registers(kind, rows, avx2_library):
    """AVX-512 VNNI machines run the int4 rows and the Q8_0 head 16 weight rows to a 512-bit
    register (and many input rows on AMX tiles where the CPU has them); each lane does what the
    256-bit kernels (the x86-64-v3 build) do, so both give the same bits."""
    from hybridllm.models.quantized import Int4Linear, Int8GroupedLinear

    narrow = avx2_library
    weight = torch.randn(104, 576, generator=torch.Generator().manual_seed(1))  # 13 blocks of 8 rows
    module = Int4Linear.from_float(weight[:96]) if kind == "int4" else Int8GroupedLinear.from_float(weight)
    view = native.linear_view(module)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(2))
    assert torch.equal(native.linear(view, x), native.linear(view, x, library=narrow))


@pytest.mark.parametrize("kind, n", [("int4", 96), ("int4", 88), ("int8_groups", 112), ("int8_groups", 104)])
def test_amx_tiles_give_the_same_bits_as_the_vector_kernels(kind, n):
    """Products of many input rows run on AMX tiles where the CPU has them: the same exact integer
    dots and the same float steps as the vector kernels, so the same bits (a row's logits do not
    depend on whether its batch ran on tiles)."""
    from hybridllm.models.quantized import Int4Linear, Int8GroupedLinear

    library = native.kernels()
    if not library.hl_amx():
        pytest.skip("no AMX tiles on this machine (the vector kernels run every batch)")
    weight = torch.randn(96 if kind == "int4" else n, 576, generator=torch.Generator().manual_seed(n))
    module = Int4Linear.from_float(weight) if kind == "int4" else Int8GroupedLinear.from_float(weight)
    if kind == "int4":  # Int4Linear needs whole 16-row groups; the blocks take any N (88: a partial block)
        module = native.NativeInt4Linear.from_codes(module.unpack_codes()[:n], module.scales_and_zeros[:, :n])
    view = native.linear_view(module)
    for rows in (4, 16, 17, 70):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        tiles = native.linear(view, x)
        try:
            assert not library.hl_set_amx(0)
            vectors = native.linear(view, x)
        finally:
            library.hl_set_amx(1)
        assert torch.equal(tiles, vectors), f"{rows} rows"
        one_by_one = torch.cat([native.linear(view, row[None]) for row in x])
        assert torch.equal(tiles, one_by_one), f"{rows} rows"
