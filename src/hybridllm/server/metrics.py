"""Prometheus metrics of one server, named like vLLM's (``vllm:`` -> ``hybridllm:``).

Every app gets its own :class:`~prometheus_client.CollectorRegistry` (no global registry), so
two servers in one process do not clash. Latency histograms and token/request counters are
updated from the scheduler's hooks (on its loop thread; prometheus_client is thread-safe);
gauges (running/waiting requests, KV bytes and pages per tier, placement) and the bus-bytes
counter are read from the engine's read-only view (:class:`~hybridllm.server.engine_view.EngineView`)
when /metrics is scraped. Monotonic totals are counters
(their names end in ``_total``), so ``rate()`` works on them.

``kv_cache_usage_perc`` is the reserved KV over what the engine can hold
(:attr:`~hybridllm.server.engine_view.EngineView.kv_holdable_bytes`): per memory (a GPU's; the
host RAM, which the host tier and a CPU "device" tier share and which is counted once) the sum
of its tiers' budgets, but no more than that memory had at start (the whole of it for an
unbounded tier).

docs/grafana-dashboard.json plots these names; tests check that every query in it resolves.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridllm.engine.adaptive import ADAPTIVE_ACTION_KINDS, AdaptiveAction
from hybridllm.engine.scheduler import SchedulerObserver, SequenceState
from hybridllm.server.engine_view import EngineView

PREFIX = "hybridllm:"

# vLLM's buckets, so its dashboards' heatmaps and quantiles fit.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics(SchedulerObserver):
    """The registry of one server and the scheduler hooks that feed it.

    Args:
        view: the engine, read at scrape time for the gauges.
        model_name: the ``model_name`` label of every series.
    """

    def __init__(self, view: EngineView, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        reg = self.registry
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             labels, buckets=ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, buckets=REQUEST_LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.queue_time = Histogram(f"{PREFIX}request_queue_time_seconds", "Time a request waited in the queue.",
                                    labels, buckets=REQUEST_LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.prefill_time = Histogram(
            f"{PREFIX}request_prefill_time_seconds", "Time from scheduling to the first token (the prefill).",
            labels, buckets=REQUEST_LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.decode_time = Histogram(
            f"{PREFIX}request_decode_time_seconds", "Time from the first token to the last (the decode).",
            labels, buckets=REQUEST_LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.inference_time = Histogram(
            f"{PREFIX}request_inference_time_seconds", "Time from scheduling to the last token.",
            labels, buckets=REQUEST_LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.request_prompt_tokens = Histogram(
            f"{PREFIX}request_prompt_tokens", "Prompt tokens per finished request.", labels,
            buckets=TOKEN_COUNT_BUCKETS, registry=reg).labels(model_name)
        self.request_generation_tokens = Histogram(
            f"{PREFIX}request_generation_tokens", "Generated tokens per finished request.", labels,
            buckets=TOKEN_COUNT_BUCKETS, registry=reg).labels(model_name)
        self.iteration_tokens = Histogram(
            f"{PREFIX}iteration_tokens_total", "Tokens per scheduler step (decode rows + prefill tokens).", labels,
            buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384), registry=reg).labels(model_name)
        self.decode_batch_size = Histogram(
            f"{PREFIX}decode_batch_size", "Sequences decoded together in one batched forward.", labels,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=reg).labels(model_name)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens prefilled.", labels,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated.", labels,
                                         registry=reg).labels(model_name)
        self.request_success = Counter(f"{PREFIX}request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=reg)
        self.rejected = Counter(f"{PREFIX}request_rejected", "Requests refused before queueing, by reason.",
                                ["model_name", "reason"], registry=reg)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(model_name, reason)
        for reason in ("queue_full", "kv_budget", "invalid", "unauthorized", "request_too_large", "shutting_down"):
            self.rejected.labels(model_name, reason)
        self.stream_pauses = Counter(
            f"{PREFIX}stream_pauses", "Times a stream's request was paused because its client fell behind (its send "
            "buffer full).", labels, registry=reg).labels(model_name)
        self.stream_stalls = Counter(
            f"{PREFIX}stream_stalls", "Streams closed (their requests aborted) because the client read nothing for "
            "--stream-stall-timeout seconds.", labels, registry=reg).labels(model_name)
        self.adaptive_actions = Counter(
            f"{PREFIX}adaptive_actions", "Re-planning actions taken while requests ran (--kv-adaptive), by kind.",
            ["model_name", "action"], registry=reg)
        for action in ADAPTIVE_ACTION_KINDS:
            self.adaptive_actions.labels(model_name, action)
        # speculative decoding, named as vLLM names its spec-decode counters
        self.spec_drafts = Counter(f"{PREFIX}spec_decode_num_drafts", "Proposals verified (speculative decoding).",
                                   labels, registry=reg).labels(model_name)
        self.spec_draft_tokens = Counter(f"{PREFIX}spec_decode_num_draft_tokens", "Tokens proposed and verified.",
                                         labels, registry=reg).labels(model_name)
        self.spec_accepted_tokens = Counter(f"{PREFIX}spec_decode_num_accepted_tokens",
                                            "Proposed tokens the model accepted.", labels, registry=reg).labels(model_name)
        self.spec_accepted_per_position = Counter(
            f"{PREFIX}spec_decode_num_accepted_tokens_per_pos", "Accepted proposed tokens by their position in the "
            "proposal (0: the first).", ["model_name", "position"], registry=reg)
        reg.register(_EngineCollector(view, model_name))

    # ---- scheduler hooks (loop thread) -----------------------------------------------------
    def on_scheduled(self, seq: SequenceState) -> None:
        self.queue_time.observe(seq.scheduled_time - seq.arrival_time)

    def on_prompt_done(self, seq: SequenceState) -> None:
        self.prompt_tokens.inc(len(seq.prompt_ids))

    def on_token(self, seq: SequenceState, interval_s: float | None) -> None:
        self.generation_tokens.inc()
        if interval_s is None:
            self.ttft.observe(seq.first_token_time - seq.arrival_time)
        else:
            self.itl.observe(interval_s)

    def on_adaptive_action(self, seq: SequenceState, action: AdaptiveAction) -> None:
        self.adaptive_actions.labels(self.model_name, action.kind).inc()

    def on_finished(self, seq: SequenceState) -> None:
        self.request_success.labels(self.model_name, seq.finish_reason or "error").inc()
        if seq.finish_reason in ("stop", "length"):
            self.e2e.observe(seq.finish_time - seq.arrival_time)
            self.prefill_time.observe(seq.first_token_time - seq.scheduled_time)
            self.decode_time.observe(seq.last_token_time - seq.first_token_time)
            self.inference_time.observe(seq.last_token_time - seq.scheduled_time)
            self.request_prompt_tokens.observe(len(seq.prompt_ids))
            self.request_generation_tokens.observe(len(seq.generated))

    def on_draft_verified(self, seq: SequenceState, draft_tokens: int, accepted: int) -> None:
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(draft_tokens)
        self.spec_accepted_tokens.inc(accepted)
        for position in range(accepted):
            self.spec_accepted_per_position.labels(self.model_name, str(position)).inc()

    def on_step(self, decode_rows: int, prefill_tokens: int) -> None:
        self.iteration_tokens.observe(decode_rows + prefill_tokens)
        if decode_rows:
            self.decode_batch_size.observe(decode_rows)

    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def on_stream_paused(self) -> None:
        """A stream's client fell behind: its request is paused (loop thread)."""
        self.stream_pauses.inc()

    def on_stream_stalled(self) -> None:
        """A stream's client read nothing for the stall timeout: its request is aborted."""
        self.stream_stalls.inc()

    # ---- exposition ----------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def token_totals(self) -> dict[str, int]:
        """Prompt tokens prefilled and tokens generated since start (the counters' values)."""
        def value(name: str) -> int:
            return int(self.registry.get_sample_value(f"{PREFIX}{name}_total", {"model_name": self.model_name}) or 0)

        return {"prompt": value("prompt_tokens"), "generated": value("generation_tokens")}


class _EngineCollector(Collector):
    """Gauges (and the bus-bytes counter) read from the engine's view at scrape time.

    Args:
        view: the engine.
        model_name: the ``model_name`` label.
    """

    def __init__(self, view: EngineView, model_name: str) -> None:
        self.view = view
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        return []  # names are stable but values are read lazily; nothing to pre-describe

    def collect(self) -> Iterator[Metric]:
        state = self.view.state()
        placement = self.view.placement
        holdable = self.view.kv_holdable_bytes
        name = self.model_name

        def gauge(metric: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name", *(labels or [])])

        g = gauge("num_requests_running", "Requests prefilling or decoding.")
        g.add_metric([name], state.running)
        yield g
        g = gauge("num_requests_waiting", "Requests in the queue.")
        g.add_metric([name], state.waiting)
        yield g
        g = gauge("num_requests_paused", "Sequences paused because their client stopped reading (KV kept, out of "
                  "the batch).")
        g.add_metric([name], state.paused)
        yield g
        g = gauge("kv_cache_bytes", "KV cache bytes held, per tier (the ledger).", ["tier"])
        for tier, n in state.kv_bytes.items():
            g.add_metric([name, tier], n)
        yield g
        g = gauge("kv_cache_pages", "KV cache pages held, per tier (pages of kv_page_size tokens).", ["tier"])
        for tier, n in state.kv_pages.items():
            g.add_metric([name, tier], n)
        yield g
        g = gauge("kv_cache_budget_bytes", "KV budget per tier (absent: unlimited).", ["tier"])
        for tier, n in state.kv_budget_bytes.items():
            if n is not None:
                g.add_metric([name, tier], n)
        yield g
        g = gauge("kv_cache_reserved_bytes", "KV bytes promised to running requests (prompt + max_tokens).")
        g.add_metric([name], state.kv_reserved_bytes)
        yield g
        g = gauge("kv_cache_usage_perc", "Reserved KV as a fraction of what the engine can hold (per memory, "
                  "counted once: its tiers' budgets, at most what it had at start).")
        g.add_metric([name], state.kv_reserved_bytes / holdable if holdable else 0.0)
        yield g
        g = gauge("kv_cache_holdable_bytes", "The denominator of kv_cache_usage_perc.")
        g.add_metric([name], holdable)
        yield g
        c = CounterMetricFamily(PREFIX + "bus_bytes", "Bytes moved between host and device since start, per "
                                "direction.", labels=["model_name", "direction"])
        for direction, n in state.bus_bytes.items():
            c.add_metric([name, direction], n)
        yield c
        prefix = state.prefix_cache
        if prefix is not None:  # vLLM's names; counted in prompt tokens
            for metric, value, doc in (("prefix_cache_queries", prefix.queries, "Prompt tokens looked up in the "
                                        "prefix cache."),
                                       ("prefix_cache_hits", prefix.hits, "Prompt tokens whose KV the prefix cache "
                                        "supplied.")):
                c = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name"])
                c.add_metric([name], value)
                yield c
            g = gauge("prefix_cache_bytes", "Bytes of reusable KV pages held by the prefix cache, per tier.", ["tier"])
            for tier, n in prefix.bytes.items():
                g.add_metric([name, tier], n)
            yield g
        g = gauge("weight_bytes", "Model weight bytes per tier (the placement).", ["tier"])
        for tier, n in state.weight_bytes.items():
            g.add_metric([name, tier], n)
        yield g
        on_device = placement.layers_on_device
        g = gauge("placement_layers", "Decoder layers whose weights are on each tier.", ["tier"])
        g.add_metric([name, "device"], on_device)
        g.add_metric([name, "host"], placement.n_layers - on_device)
        yield g
        g = gauge("placement_info", "The current placement (value 1; the labels describe it).",
                  ["device", "dtype", "weights", "kv_cache", "kv_page_size", "max_batch", "prefill_chunk",
                   "n_gpu_layers", "decode_on"])
        g.add_metric([name, placement.device, placement.dtype, placement.weights_format, placement.kv_strategy,
                      str(placement.kv_page_size), str(placement.max_batch), str(placement.prefill_chunk),
                      str(on_device), placement.decode_on], 1)
        yield g
