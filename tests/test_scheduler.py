"""The continuous-batching scheduler: admission on plain numbers, batched greedy == LLM.generate,
aborts free KV at once, budgets make requests wait or fail, tiered KV spills to the host under
pressure instead of preempting."""

from __future__ import annotations

import time

import pytest
import torch
from serving_helpers import CHAT_PROMPTS, MAX_TOKENS, reference
from tiny_models import build_hf_model

from hybridllm import LLM, SamplingParams
from hybridllm.engine.scheduler import (
    AdmissionError,
    QueueFullError,
    Scheduler,
    SchedulerObserver,
    SeqEvent,
    admission_decision,
    kv_bytes_needed,
)
from hybridllm.errors import ContextOverflowError
from hybridllm.kvcache.batch import BatchedCaches


class Collector:
    """Per-request event lists, filled by the scheduler's sinks."""

    def __init__(self) -> None:
        self.events: dict[str, list[SeqEvent]] = {}

    def sink(self, request_id: str):
        self.events[request_id] = []
        return self.events[request_id].append

    def text(self, request_id: str) -> str:
        return "".join(e.text for e in self.events[request_id])

    def last(self, request_id: str) -> SeqEvent:
        return self.events[request_id][-1]


# ---- admission on plain numbers -------------------------------------------------------------
def test_kv_bytes_needed_rounds_up_to_whole_pages():
    assert kv_bytes_needed(0, 100, 16) == 0
    assert kv_bytes_needed(1, 100, 16) == 1600
    assert kv_bytes_needed(16, 100, 16) == 1600
    assert kv_bytes_needed(17, 100, 16) == 3200
    with pytest.raises(ValueError):
        kv_bytes_needed(1, 100, 0)


def test_admission_decision_admits_waits_or_rejects():
    assert admission_decision(100, 0, None) == "admit"
    assert admission_decision(10**15, 10**15, None) == "admit"
    assert admission_decision(600, 0, 1000) == "admit"
    assert admission_decision(400, 600, 1000) == "admit"  # exactly full is fine
    assert admission_decision(401, 600, 1000) == "wait"  # fits once others finish
    assert admission_decision(1001, 0, 1000) == "reject"  # never fits


# ---- tiny model: budgets, aborts, queue -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sched") / "llama"
    build_hf_model(folder, "llama")
    return folder


@pytest.fixture(scope="module")
def tiny_weight_bytes(tiny_folder, shared_llm) -> int:
    return shared_llm(model=tiny_folder).weight_bytes["device"]


def long_params(n: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_request_that_can_never_fit_is_rejected_and_one_that_fits_later_waits(tiny_folder, tiny_weight_bytes):
    page = 16
    llm = LLM(model=tiny_folder, kv_page_size=page, vram_budget=tiny_weight_bytes + 10 * page * 512,
              kv_adaptive=False)
    sched = Scheduler(llm.runtime, max_batch=8)
    assert sched.token_bytes == 512  # 2 layers x (K+V) x 2 kv heads x 16 dims x 4 bytes
    assert sched.capacity == 10 * page * 512  # dynamic: the device tier only
    prompt = llm.encode_prompt("The quick brown fox")
    with pytest.raises(AdmissionError, match="bytes of KV"):
        sched.submit("huge", prompt, long_params(11 * page), Collector().sink("huge"))
    out = Collector()
    n_new = 6 * page - len(prompt)  # each request reserves 6 of the 10 pages
    sched.submit("a", prompt, long_params(n_new), out.sink("a"))
    sched.submit("b", prompt, long_params(n_new), out.sink("b"))
    sched.step()
    assert (sched.num_running, sched.num_waiting) == (1, 1)  # b waits for a's KV
    assert sched.reserved_bytes == 6 * page * 512
    assert sched.ledger.current("device") == 6 * page * 512
    sched.run_until_idle()
    assert out.last("a").finish_reason == out.last("b").finish_reason == "length"
    assert out.text("a") == out.text("b")
    assert sched.ledger.peak("device") <= sched.capacity
    assert sched.ledger.current("device") == 0 and sched.reserved_bytes == 0


def test_abort_frees_kv_at_once_and_removes_waiting_requests(tiny_folder):
    llm = LLM(model=tiny_folder)
    sched = Scheduler(llm.runtime, max_batch=2)
    out = Collector()
    prompt = llm.encode_prompt("Paris is the capital")
    for rid in ("a", "b", "c"):
        sched.submit(rid, prompt, long_params(200), out.sink(rid))
    for _ in range(3):
        sched.step()
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    both = sched.ledger.current("device")
    sched.abort("c")  # waiting: gone from the queue immediately
    assert sched.num_waiting == 0
    sched.abort("a")
    sched.step()
    assert sched.num_running == 1
    assert sched.ledger.current("device") == both // 2
    sched.abort("b")
    sched.step()
    assert sched.num_running == 0 and sched.ledger.current("device") == 0 and sched.reserved_bytes == 0
    assert not any(e.finished for rid in "abc" for e in out.events[rid])  # aborted requests get no final event
    sched.abort("unknown")  # harmless
    sched.run_until_idle()


def test_full_queue_and_bad_prompts_are_refused(tiny_folder):
    llm = LLM(model=tiny_folder)
    sched = Scheduler(llm.runtime, max_queue=1)
    prompt = llm.encode_prompt("hello")
    sched.submit("a", prompt, long_params(2), Collector().sink("a"))
    with pytest.raises(QueueFullError):
        sched.submit("b", prompt, long_params(2), Collector().sink("b"))
    with pytest.raises(ContextOverflowError):
        sched.submit("empty", [], long_params(2), Collector().sink("empty"))
    with pytest.raises(ContextOverflowError):
        sched.submit("long", [1] * llm.config.max_position_embeddings, long_params(2), Collector().sink("long"))
    with pytest.raises(ContextOverflowError):
        sched.submit("vocab", [llm.config.vocab_size], long_params(2), Collector().sink("vocab"))
    sched.run_until_idle()


def test_loop_thread_serves_requests_and_stops(tiny_folder):
    import threading

    llm = LLM(model=tiny_folder)
    sched = Scheduler(llm.runtime)
    done = threading.Event()
    events: list[SeqEvent] = []

    def sink(event: SeqEvent) -> None:
        events.append(event)
        if event.finished:
            done.set()

    sched.start()
    try:
        sched.submit("a", llm.encode_prompt("hello"), long_params(5), sink)
        assert done.wait(60)
    finally:
        sched.stop()
    assert events[-1].finish_reason == "length" and events[-1].completion_tokens == 5
    assert not sched.is_running


@pytest.mark.parametrize("page", [16, 8])
def test_tiered_kv_spills_cold_pages_to_the_host_under_device_pressure(tiny_folder, tiny_weight_bytes, page):
    # device room for 10 pages (all layers); 4 sequences of 17-token prompts + 28 new tokens need more.
    # With 8-token pages not even the 4 prompts fit: later ones wait for device room, none fails.
    budget = 10 * page * 512
    llm = LLM(model=tiny_folder, kv_cache="tiered", kv_page_size=page, kv_hot_window=4096,
              vram_budget=tiny_weight_bytes + budget)
    sched = Scheduler(llm.runtime, max_batch=4)
    out = Collector()
    prompt = llm.encode_prompt("Hybrid inference splits")
    assert len(prompt) == 17
    for i in range(4):
        sched.submit(str(i), prompt, long_params(28), out.sink(str(i)))
    sched.run_until_idle()
    assert all(out.last(str(i)).finish_reason == "length" for i in range(4))  # nobody preempted or failed
    assert len({out.text(str(i)) for i in range(4)}) == 1
    assert max(sched.decode_batch_sizes) >= 2  # they shared the device rather than running one by one
    assert sched.ledger.peak("host") > 0  # cold pages went to the host
    assert sched.ledger.peak("device") <= budget
    assert sched.ledger.current("device") == sched.ledger.current("host") == 0


def test_tiered_device_budget_too_small_for_a_first_chunk_is_rejected(tiny_folder, tiny_weight_bytes):
    llm = LLM(model=tiny_folder, kv_cache="tiered", kv_page_size=8, vram_budget=tiny_weight_bytes + 2 * 8 * 512,
              kv_adaptive=False)
    sched = Scheduler(llm.runtime)
    with pytest.raises(AdmissionError, match="first prefill chunk"):
        sched.submit("a", llm.encode_prompt("Hybrid inference splits"), long_params(4), Collector().sink("a"))


def test_adaptive_capacity_counts_the_host_and_moves_sequences_there(tiny_folder, tiny_weight_bytes):
    # device room for 4 pages of KV; each request needs 6: without the policy they are refused,
    # with it (the default) they run, move to the host runner when the device fills, and finish
    page = 16
    budget = dict(kv_page_size=page, vram_budget=tiny_weight_bytes + 4 * page * 512)
    prompt_text, n_new = "The quick brown fox", 6 * page - 5
    strict = Scheduler(LLM(model=tiny_folder, kv_adaptive=False, **budget).runtime, host_budget=10**9)
    prompt = strict.tokenizer.encode(prompt_text)
    with pytest.raises(AdmissionError, match="bytes of KV"):
        strict.submit("a", prompt, long_params(n_new), Collector().sink("a"))
    llm = LLM(model=tiny_folder, **budget)
    seen: list[str] = []

    class Observer(SchedulerObserver):
        def on_adaptive_action(self, seq, action):
            seen.append(action.kind)

    sched = Scheduler(llm.runtime, max_batch=4, host_budget=10**9, observer=Observer())
    assert sched.capacity == 4 * page * 512 + 10**9
    out = Collector()
    for rid in "ab":
        sched.submit(rid, prompt, long_params(n_new), out.sink(rid))
    sched.run_until_idle()
    reference_ids = LLM(model=tiny_folder).generate(prompt, long_params(n_new)).token_ids
    for rid in "ab":
        last = out.last(rid)
        assert last.finish_reason == "length" and last.token_ids == reference_ids
        assert last.metrics["decode_on"] == "host"
        assert any("decoding moved to the host" in action for action in last.metrics["adaptive_actions"])
    assert seen.count("move_to_host") == 2
    assert sched.runtime.host_runner is not None
    assert sched.ledger.current("device") == sched.ledger.current("host") == 0


def test_idle_steps_prefill_several_chunks_and_decoding_steps_one(tiny_folder):
    """While no sequence decodes, a step prefills up to IDLE_PREFILL_CHUNKS chunks' worth of
    prompts (in chunks of prefill_chunk); once sequences decode, a step prefills at most one
    chunk's worth; every request still gets its tokens alone."""
    from hybridllm.engine.scheduler import IDLE_PREFILL_CHUNKS

    chunk = 16
    llm = LLM(model=tiny_folder, prefill_chunk=chunk)
    steps: list[tuple[int, int]] = []

    class Observer(SchedulerObserver):
        def on_step(self, decode_rows, prefill_tokens):
            steps.append((decode_rows, prefill_tokens))

    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + j) % 200 + 5 for j in range(12)] for i in range(IDLE_PREFILL_CHUNKS + 4)]  # 12 tokens each
    sched = Scheduler(llm.runtime, max_batch=len(prompts), observer=Observer())
    out = Collector()
    for i, prompt in enumerate(prompts):
        sched.submit(f"r{i}", prompt, params, out.sink(f"r{i}"))
    sched.run_until_idle()
    (first_decode, first_prefill), (second_decode, second_prefill) = steps[:2]
    assert first_decode == 0 and chunk < first_prefill <= IDLE_PREFILL_CHUNKS * chunk  # several prompts at once
    assert second_decode > 0 and 0 < second_prefill <= chunk  # the first ones decode: one chunk's worth
    assert sum(prefill for _, prefill in steps) == 12 * len(prompts)
    for i, prompt in enumerate(prompts):
        assert out.last(f"r{i}").token_ids == llm.generate(prompt, params).token_ids


# ---- the default model: batched greedy == single-request generate ----------------------------
@pytest.mark.slow
def test_batched_greedy_equals_single_request_generate(default_llm):
    # one request ends on a stop string mid-batch: a word from the middle of its own greedy answer
    words = reference(default_llm, CHAT_PROMPTS[2]).text.split()
    stops = {2: (words[len(words) // 2],)}
    sched = Scheduler(default_llm.runtime, max_batch=16)
    out = Collector()
    for i, prompt in enumerate(CHAT_PROMPTS):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=list(stops.get(i, ())))
        sched.submit(str(i), default_llm.encode_prompt([{"role": "user", "content": prompt}]), params,
                     out.sink(str(i)))
    sched.run_until_idle()
    assert max(sched.decode_batch_sizes) == len(CHAT_PROMPTS)  # all eight decoded in one forward
    for i, prompt in enumerate(CHAT_PROMPTS):
        ref = reference(default_llm, prompt, MAX_TOKENS, stops.get(i, ()))
        last = out.last(str(i))
        assert last.token_ids == ref.token_ids, prompt
        assert out.text(str(i)) == last.full_text == ref.text
        assert last.finish_reason == ref.finish_reason
        assert last.prompt_tokens == len(ref.prompt_token_ids) and last.completion_tokens == len(ref.token_ids)
    assert out.last("2").finish_reason == "stop" and stops[2][0] not in out.text("2")
    assert sched.ledger.current("device") == 0


def test_batched_caches_route_rows_to_their_own_caches(default_llm):
    """One batched forward over sequences of different lengths == each sequence alone."""
    model = default_llm.runner
    prompts = [default_llm.encode_prompt(p) for p in ("Hello there", "The capital of France is a city that")]
    with torch.inference_mode():
        caches, firsts, refs = [], [], []
        for ids in prompts:
            cache = default_llm.new_cache()
            firsts.append(int(model(torch.tensor([ids]), cache, start_pos=0)[0, -1].argmax()))
            caches.append(cache)
            alone = default_llm.new_cache()
            model(torch.tensor([ids]), alone, start_pos=0)
            refs.append(model(torch.tensor([[firsts[-1]]]), alone, start_pos=len(ids))[0, -1])  # (vocab,)
            alone.reset()
        batch = BatchedCaches(caches)
        assert batch.seq_lengths == [len(p) for p in prompts]
        logits = model(torch.tensor([[f] for f in firsts]), batch, start_pos=batch.start_positions())  # (2, 1, V)
    assert batch.seq_lengths == [len(p) + 1 for p in prompts]
    for row, ref in enumerate(refs):
        assert int(logits[row, -1].argmax()) == int(ref.argmax())
        # same math; only the matmul blocking differs with the batch size (last-bit differences)
        torch.testing.assert_close(logits[row, -1], ref, rtol=1e-4, atol=1e-4)
    for cache in caches:
        cache.reset()


@pytest.mark.parametrize("placement", [{"n_gpu_layers": 1}, {"n_gpu_layers": 1, "decode_on": "host"},
                                       {"decode_on": "host", "kv_cache": "tiered", "kv_page_size": 4,
                                        "kv_hot_window": 8}])
def test_batched_placements_equal_single_request_generate(tiny_folder, placement, shared_llm):
    llm = LLM(model=tiny_folder, **placement)
    reference_llm = shared_llm(model=tiny_folder)
    sched = Scheduler(llm.runtime, max_batch=4)
    out = Collector()
    prompts = ["The quick brown fox", "Paris is", "Hybrid inference splits layers", "hello"]
    for i, text in enumerate(prompts):
        sched.submit(str(i), llm.encode_prompt(text), long_params(12), out.sink(str(i)))
    sched.run_until_idle()
    for i, text in enumerate(prompts):
        assert out.last(str(i)).token_ids == reference_llm.generate(text, long_params(12)).token_ids
    assert sched.ledger.current("device") == sched.ledger.current("host") == 0
    stats = sched.stats()
    if placement.get("decode_on") == "host":
        assert sched.runtime.host_runner is not None and sched.runtime.host_runner is not sched.runtime.runner
        assert stats["bus_bytes"]["d2h"] > 0  # every prompt's KV crossed to the host
    if placement.get("n_gpu_layers") == 1:
        assert stats["bus_bytes"]["hidden_states"] > 0


@pytest.mark.parametrize("loop_thread", [False, True])
def test_a_cancelled_stream_ends_without_a_result_and_frees_its_kv(tiny_folder, loop_thread):
    """``stream(..., cancel=)`` (chat's Ctrl-C): the stream ends before the next step, the request
    is aborted and its KV freed, and the loop serves the next request as usual; whether the caller
    steps the loop or the loop runs on its own thread (the server's way)."""
    import threading

    from hybridllm.engine.llm_engine import LLMEngine

    llm = LLM(model=tiny_folder)
    engine = LLMEngine(llm.runtime)
    prompt = llm.encode_prompt("Hybrid inference splits")
    cancel = threading.Event()
    if loop_thread:
        engine.scheduler.start()
    try:
        events = []
        for event in engine.stream(prompt, long_params(200), cancel=cancel):
            events.append(event)
            if len(events) == 3:
                cancel.set()
        assert len(events) == 3 and all(event.result is None for event in events)
        if loop_thread:  # the loop frees an aborted sequence at the start of its next step
            deadline = time.monotonic() + 30
            while engine.scheduler.num_running and time.monotonic() < deadline:
                time.sleep(0.01)
        sched = engine.scheduler
        assert sched.num_running == sched.num_waiting == sched.reserved_bytes == 0
        assert sched.ledger.current("device") == sched.ledger.current("host") == 0
        after = engine.generate(prompt, long_params(5))
        assert after.finish_reason == "length" and len(after.token_ids) == 5
    finally:
        if loop_thread:
            engine.scheduler.stop()
