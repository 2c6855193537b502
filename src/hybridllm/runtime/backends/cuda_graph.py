"""The ``cuda-graph`` backend: a decode step over static KV buffers, captured once per batch bucket.

A decode step on a GPU is launch-bound when every kernel is issued from Python (the issue's
H100 profile: ~460 launches per token). Here the whole step (embedding, every layer, the head)
reads and writes only fixed tensors: the sequences' KV in the rows of one
:class:`~hybridllm.kvcache.static.StaticKVPool`, and a (4, 64) int64 input block (token ids,
positions, the column each row writes, the keys each row sees). Nothing in the step syncs with
the host or branches on data, so on CUDA it is captured once per (batch bucket, key span) with
``torch.cuda.CUDAGraph`` and replayed; on the CPU the very same step runs eagerly.

- Batch buckets (:data:`BATCH_BUCKETS`): a batch decodes over the pool's first ``bucket`` rows,
  the next bucket above its highest row. Rows of the bucket that are not in the batch (free rows,
  sequences still in prefill) are padding: they write into the pool's scratch column and see one
  key, so no real sequence's KV is touched.
- Key span: the step attends over the first ``span`` columns, the next power of two above the
  longest row (at least :data:`MIN_KEY_SPAN`), so a 4K sequence in a 32K pool reads 4-8K keys,
  not 32K (a graph per span: the attention's shape is part of the graph).
- The pool grows (rows, capacity) by reallocation; graphs over the old buffers are dropped and
  captured again on next use (``generation``).
- Decode attention by measurement: each (bucket, span) is captured with every applicable form of
  the static attention (:data:`DECODE_ATTENTION`: one SDPA call with a length mask, the keys
  split in chunks, flash-decoding style, two batched products that read K and V in place, or two
  Triton kernels that split the keys and read them in place, :mod:`hybridllm.kvcache.triton_decode`), each
  graph is replayed a few times, and the fastest is kept (``attention_choice`` records the
  timings). On the CPU the first form applies.

- The elementwise chain between the products (norms, residual adds, rotary and the KV write,
  SwiGLU's gate) as three fused Triton kernels where Triton runs and the model is plain
  (:func:`fusable`; :mod:`hybridllm.models.triton_fused`).
- One step ahead (:mod:`~hybridllm.runtime.backends.lookahead`): on CUDA, right after a step the
  next one is launched on a side stream with each row's argmax as its token, so the host's
  sampling and bookkeeping overlap the device's next step; the engine's next call takes its
  logits when its tokens are the guess, else the step runs as usual.

Placement: every layer, the embedding and the head on the device, dense KV (``dynamic``),
decoding on the device (:meth:`CudaGraphBackend.check_placement`). The runtime asks the backend
for its caches (:meth:`CudaGraphBackend.new_cache`): a :class:`~hybridllm.kvcache.static.StaticSlotCache`
per sequence. Prefill chunks run the model's own code over the sequence's row.
"""

from __future__ import annotations

import importlib.util
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridllm.errors import ConfigError
from hybridllm.kvcache.attention import (batched_products_decode_attention, layer_attention,
                                         length_masked_decode_attention, split_kv_decode_attention)
from hybridllm.kvcache.base import KVCache, KVSpec, MemoryLedger
from hybridllm.kvcache.static import StaticKVPool, StaticSlotCache
from hybridllm.models.layers import RMSNorm, SwiGLU
from hybridllm.models.llama import DecoderLayer, LlamaForCausalLM
from hybridllm.placement.placement import Placement
from hybridllm.runtime.backends.eager import EagerBackend
from hybridllm.runtime.backends.lookahead import AheadStep, LookaheadPolicy, argmax_rows
from hybridllm.runtime.forward_batch import ForwardBatch, ForwardRow
from hybridllm.runtime.placed_model import PlacedModel

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_KEY_SPAN = 256
DENSE_STRATEGIES = ("dynamic",)

# rows of the input block the static step reads, each (max bucket,) int64
IDS, POSITIONS, COLUMNS, LENGTHS = range(4)
# the forms of the static step's attention, tried in this order (the first one serves the CPU)
DECODE_ATTENTION = ("sdpa", "split", "gemm", "triton", "triton-coarse")
SPLIT_CHUNKS = (256, 128, 64)  # keys per chunk of the split form: the first that divides the span
TIMED_REPLAYS = 3
STEP_TOKENS_MAX = 16  # rows of at most this many tokens go through the static step token by token (on CUDA)


def batch_bucket(rows: int) -> int | None:
    """The smallest bucket holding ``rows`` rows (None: more than the largest bucket)."""
    return next((bucket for bucket in BATCH_BUCKETS if bucket >= rows), None)


def key_span(longest: int, capacity: int) -> int:
    """Keys a step attends over: the next power of two >= ``longest`` (at least
    :data:`MIN_KEY_SPAN`), at most the pool's capacity."""
    return min(capacity, max(MIN_KEY_SPAN, 1 << (longest - 1).bit_length()))


def split_chunk(span: int) -> int | None:
    """Keys per chunk of the split attention over ``span`` keys (None: no chunk size divides it)."""
    return next((chunk for chunk in SPLIT_CHUNKS if span % chunk == 0), None)


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton form can run on ``device``: Triton installed, and the device a GPU, or
    the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, the tests)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def fusable(model: LlamaForCausalLM) -> bool:
    """Whether the static step can run ``model``'s elementwise chain as the fused Triton kernels
    (:mod:`hybridllm.models.triton_fused`): plain pre-norm layers (no Gemma norms), SwiGLU, no
    q/k norms, one rotary table."""
    return model.rotary.inv_freq.shape[0] == 1 and isinstance(model.model.norm, RMSNorm) and all(
        type(layer) is DecoderLayer and type(layer.mlp) is SwiGLU and isinstance(layer.self_attn.q_norm, torch.nn.Identity)
        and isinstance(layer.input_layernorm, RMSNorm) and isinstance(layer.post_attention_layernorm, RMSNorm)
        for layer in model.layers)


def static_decode_attention(variant: str, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            lengths: torch.Tensor) -> torch.Tensor:
    """The static step's attention in form ``variant`` (one of :data:`DECODE_ATTENTION`): q
    (B, H, 1, D) over keys/values (B, Hkv, span, D) with ``lengths`` (B,) visible keys per row ->
    (B, H, 1, D)."""
    if variant in ("triton", "triton-coarse"):  # imported here: Triton is not a dependency of the CPU paths
        from hybridllm.kvcache.triton_decode import COARSE_PROGRAMS, TARGET_PROGRAMS, triton_decode_attention

        programs = COARSE_PROGRAMS if variant == "triton-coarse" else TARGET_PROGRAMS
        return triton_decode_attention(q, keys, values, lengths, programs)
    if variant == "split":
        return split_kv_decode_attention(q, keys, values, lengths, split_chunk(keys.shape[2]))
    if variant == "gemm":
        return batched_products_decode_attention(q, keys, values, lengths)
    return length_masked_decode_attention(q, keys, values, lengths)


@dataclass
class CapturedStep:
    """A captured decode step, its static output (bucket, 1, vocab) and its attention form."""

    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    attention: str


class CudaGraphBackend(EagerBackend):
    """Decode steps over static KV buffers, replayed from CUDA graphs (eager on the CPU)."""

    name = "cuda-graph"
    compiles_lazily = True  # the first steps capture graphs: the build's warm-up captures bucket 1

    def __init__(self, placed: PlacedModel) -> None:
        super().__init__(placed)
        model = self.model
        if layer_attention(model.config):  # its captured step attends plainly over a static row
            raise ConfigError("the cuda-graph decode backend has no sliding-window, scaled or soft-capped attention "
                              "(this model has them); choose --decode-backend eager or compiled")
        if model.rotary.longrope:  # its rotary table is built once for every position of the pool
            raise ConfigError("the cuda-graph decode backend has no longrope rotary tables (this model's); "
                              "choose --decode-backend eager or compiled")
        self.device = model.lm_head.weight.device
        self.captures = self.device.type == "cuda"
        self.pool: StaticKVPool | None = None
        self._generation = -1
        self._graphs: dict[tuple[int, int], CapturedStep] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.captures else None
        self._inputs = torch.zeros(4, BATCH_BUCKETS[-1], dtype=torch.long, device=self.device)
        self._padding = torch.zeros(4, BATCH_BUCKETS[-1], dtype=torch.long)
        self._row_index = torch.arange(BATCH_BUCKETS[-1], device=self.device)
        self._cos = self._sin = torch.empty(0)
        self.steps_by_bucket: Counter[int] = Counter()  # static steps run, per batch bucket
        self.attention_variants: tuple[str, ...] = DECODE_ATTENTION  # the forms tried (tests narrow it)
        self.triton = triton_runs_on(self.device)  # once: a module lookup is ~25 us, and _variants runs every CPU step
        # the elementwise chain as fused Triton kernels where they run (tests switch it)
        self.fused_elementwise = self.triton and fusable(model)
        # the next step launched ahead on the greedy guess (lookahead.py): on CUDA, where the host's
        # work then overlaps the device's; on the CPU it would only add work (tests switch it on)
        self.lookahead = self.captures
        self.lookahead_policy = LookaheadPolicy()
        self._ahead: AheadStep | None = None
        self._side_stream = torch.cuda.Stream(self.device) if self.captures else None
        # rows of at most this many tokens (short prompts, verified drafts) go token by token through
        # the static step, batched with the others, instead of a walk of their own: on CUDA a walk is
        # ~500 launches (~20 ms on the H200's host at any short length), a replay ~1.2 ms per token
        # for a whole batch (16 prompts arriving together: one walk each was 0.32 s of TTFT)
        self.step_tokens_max = STEP_TOKENS_MAX if self.captures else 1
        self.attention_choice: dict[tuple[int, int], dict[str, float]] = {}  # (bucket, span) -> ms per form
        self.report.whole_step = True
        self.report.notes.append("cuda-graph: static KV rows, a step per batch bucket "
                                 f"{'/'.join(map(str, BATCH_BUCKETS))} and key span, "
                                 + ("captured and replayed" if self.captures else "run eagerly (no CUDA)")
                                 + (", the elementwise chain fused (Triton)" if self.fused_elementwise else "")
                                 + (", each step launched one ahead on the greedy guess" if self.lookahead else ""))

    # ---- build-time ----------------------------------------------------------------------
    def check_placement(self, placement: Placement) -> None:
        problems = []
        if any(tier != "device" for tier in [*placement.layer_tiers, placement.embed_tier, placement.head_tier]):
            problems.append("every layer, the embedding and the head on the device (no --n-gpu-layers split)")
        if placement.kv.kv_cache not in DENSE_STRATEGIES:
            problems.append(f"dense KV (--kv-cache {'/'.join(DENSE_STRATEGIES)}), not {placement.kv.kv_cache}")
        if placement.decode_on != "device":
            problems.append("decoding on the device (not --decode-on host)")
        if problems:
            raise ConfigError("the cuda-graph decode backend needs " + "; ".join(problems)
                              + "; choose --decode-backend eager or compiled otherwise")

    def new_cache(self, spec: KVSpec, ledger: MemoryLedger) -> KVCache:
        """A sequence's cache: a row of the one pool every sequence of this model shares."""
        self._join_ahead()  # a new row may grow the pool: after any step in flight on the side stream
        if self.pool is None:
            self.pool = StaticKVPool(spec)
        elif self.pool.spec != spec:
            raise ConfigError("the cuda-graph decode backend serves one KV shape per model")
        return StaticSlotCache(spec, ledger, self.pool)

    @property
    def captured_keys(self) -> list[tuple[int, int]]:
        """The (batch bucket, key span) steps captured over the pool's current buffers."""
        return list(self._graphs)

    # ---- the step ------------------------------------------------------------------------
    def step(self, batch: ForwardBatch) -> list[torch.Tensor]:
        """The rows of this backend's static caches through the static step (a captured graph on
        CUDA): one-token rows in one step, and short rows (prompts of at most
        :attr:`step_tokens_max` tokens, verified drafts) token by token in steps shared with the
        others; every other row (longer prefill chunks) walks the layers."""
        self._join_ahead()
        rows = batch.rows
        out: list[torch.Tensor | None] = [None] * len(rows)
        stepped = [i for i, row in enumerate(rows) if row.n_tokens <= max(1, self.step_tokens_max)]
        for i, row_logits in zip(stepped, self._static_steps([rows[i] for i in stepped]) or []):
            out[i] = row_logits
        rest = [i for i in range(len(rows)) if out[i] is None]
        if rest:
            self._join_ahead()  # the walk may grow the pool (freeing the buffers a step ahead uses)
            for i, row_logits in zip(rest, self.walk_rows([rows[i] for i in rest])):
                out[i] = row_logits
        return out

    def _static_steps(self, rows: list[ForwardRow]) -> list[torch.Tensor] | None:
        """Each row's logits ((T or 1, vocab), as ``walk_rows`` gives them) from as many static
        steps as its longest row has tokens: step j runs token j of every row that has one. None
        when the pool cannot serve them (a row's cache is not a row of the pool, or more rows than
        the largest bucket)."""
        if not rows:
            return None
        caches = [row.cache for row in rows]
        if self.pool is None or not all(isinstance(c, StaticSlotCache) and c.pool is self.pool for c in caches):
            return None
        if batch_bucket(max(cache.slot() for cache in caches) + 1) is None:
            return None  # more rows than the largest bucket: the eager walk serves them
        n_steps = max(row.n_tokens for row in rows)
        collected: list[list[torch.Tensor]] = [[] for _ in rows]
        for j in range(n_steps):
            now = [k for k, row in enumerate(rows) if j < row.n_tokens]
            logits = self._static_step([caches[k] for k in now], [int(rows[k].token_ids[j]) for k in now],
                                       look_ahead=j == n_steps - 1)  # (B, 1, vocab); a guess only after a row's last token
            for k, row_logits in zip(now, logits):
                collected[k].append(row_logits)  # (1, vocab)
        return [torch.cat(steps) if row.all_logits else steps[-1] for row, steps in zip(rows, collected)]

    def _static_step(self, caches: list[StaticSlotCache], tokens: list[int], look_ahead: bool = True) -> torch.Tensor:
        """Logits (B, 1, vocab) of one token per cache (rows of the pool, at most the largest
        bucket) in one static step, in batch order; then, with ``look_ahead``, the next step
        launched ahead on the greedy guess."""
        pool = self.pool
        slots = [cache.slot() for cache in caches]
        bucket = batch_bucket(max(slots) + 1)
        longest = max(cache.seq_length for cache in caches) + 1
        pool.ensure_capacity(longest)
        self._follow_pool()
        positions = [cache.seq_length for cache in caches]
        ahead, self._ahead = self._ahead, None
        logits = self._taken_ahead(ahead, self._step_key(bucket, slots, positions), slots, tokens)
        for cache in caches:
            cache.advance_all()
        self.steps_by_bucket[bucket] += 1
        if logits is None:
            logits = self._run(bucket, key_span(longest, pool.capacity),
                               lambda: self._write_inputs(bucket, slots, positions, tokens))
        out = logits.index_select(0, self._to_device(torch.tensor(slots)))  # (B, 1, vocab), batch order
        if look_ahead and self.lookahead and longest < pool.capacity and self.lookahead_policy.wants_guess():
            self._ahead = self._run_ahead(bucket, slots, [p + 1 for p in positions], logits,
                                          key_span(longest + 1, pool.capacity))
        return out

    def _write_inputs(self, bucket: int, slots: list[int], positions: list[int], tokens: list[int] | None) -> None:
        """The input block of a step over the first ``bucket`` rows: each slot's token (None: left
        for the device to write), position, column and visible keys; the other rows padded."""
        step_inputs = self._padding[:, :bucket].clone()  # (4, bucket)
        table = step_inputs.numpy()
        for i, (slot, position) in enumerate(zip(slots, positions)):
            table[:, slot] = (0 if tokens is None else tokens[i], position, position, position + 1)
        self._inputs[:, :bucket].copy_(self._to_device(step_inputs))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the device without waiting for the stream: through pinned memory, copied
        without blocking (a plain copy from pageable memory synchronizes the stream, which after
        :meth:`_join_ahead` means waiting for the step in flight: no overlap)."""
        if not self.captures:
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _run(self, bucket: int, span: int, write_inputs: Callable[[], None]) -> torch.Tensor:
        """The step over the input block that ``write_inputs`` fills: a graph replay on CUDA (its
        logits buffer, (bucket, 1, vocab)), the step itself on the CPU.

        The inputs are written after the graph is captured: a capture (on a key's first use) pads
        the input block for its warm-up and timed replays (the first H200 run of this code wrote
        them before and replayed each fresh capture over padding).
        """
        captured = self._captured(bucket, span) if self.captures else None
        write_inputs()
        if captured is None:
            return self._forward(bucket, span, self._variants(span)[0])
        captured.graph.replay()
        return captured.logits

    # ---- one step ahead (lookahead.py) ---------------------------------------------------------
    def _step_key(self, bucket: int, slots: list[int], positions: list[int]) -> tuple:
        """What makes two static steps the same step: the pool's buffers, the bucket, and each row's
        slot and position (:attr:`AheadStep.key`)."""
        return self.pool.generation, bucket, tuple(zip(slots, positions))

    def _taken_ahead(self, ahead: AheadStep | None, key: tuple, slots: list[int], tokens: list[int]
                     ) -> torch.Tensor | None:
        """The logits of the step launched ahead when it is this step (the same rows at the same
        positions, the engine's tokens equal to the guess), else None (the guess is dropped)."""
        if ahead is None or ahead.key != key:
            return None
        if ahead.guessed(slots) != tokens:
            self.lookahead_policy.miss()
            return None
        self.lookahead_policy.hit()
        return ahead.logits

    def _run_ahead(self, bucket: int, slots: list[int], positions: list[int], logits: torch.Tensor,
                   span: int) -> AheadStep:
        """Launch the step after this one, each row's token the argmax of its ``logits`` (bucket, 1,
        vocab), written into the input block on the device; on CUDA on the side stream (the
        engine's sampling of this step goes on meanwhile), on the CPU at once."""
        key = self._step_key(bucket, slots, positions)
        guess = argmax_rows(logits[:, 0])  # (bucket,) on the device

        def write_inputs() -> None:
            self._write_inputs(bucket, slots, positions, None)
            self._inputs[IDS, :bucket].copy_(guess)

        if not self.captures:
            return AheadStep(key, guess, None, self._run(bucket, span, write_inputs))
        self._captured(bucket, span)  # a first use captures here, on the current stream, not the side one
        guess_host = torch.empty(bucket, dtype=torch.long, pin_memory=True)
        guess_host.copy_(guess, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        guess.record_stream(side)  # made on this stream, read on the side one: not reused before that
        with torch.cuda.stream(side):
            ahead_logits = self._run(bucket, span, write_inputs)
        return AheadStep(key, guess_host, copied, ahead_logits)

    def _join_ahead(self) -> None:
        """Order what the current stream does next after the step in flight on the side stream
        (no host wait): it writes the pool and the logits buffers the next work reads or frees."""
        if self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)

    def _follow_pool(self) -> None:
        """After the pool reallocated: drop the graphs over the old buffers, rebuild the rotary
        tables for the new capacity and the padding's scratch column.

        The new graphs capture into a new private memory pool. Destroying every graph of a pool
        drops its use count to zero while blocks allocated during capture (cuBLAS's workspace for
        the capture stream) stay alive, and PyTorch then refuses a capture into that pool id
        (``use_count > 0 INTERNAL ASSERT``: what the first H100 run hit after prefill grew the pool).
        """
        pool = self.pool
        if pool.generation == self._generation:
            return
        self._graphs.clear()
        if self.captures:  # a fresh memory pool for the new graphs (see the docstring)
            self._graph_pool = torch.cuda.graph_pool_handle()
        cos, sin = self.model.rotary.cos_sin(torch.arange(pool.capacity)[None], self.model.compute_dtype)
        self._cos, self._sin = cos[0, 0].to(self.device), sin[0, 0].to(self.device)  # (capacity, rotary_dim)
        self._padding[COLUMNS] = pool.scratch_column
        self._padding[LENGTHS] = 1
        self._generation = pool.generation

    def _variants(self, span: int) -> list[str]:
        """The attention forms that apply to ``span`` keys on this device, in preference order."""
        applies = {"split": split_chunk(span) is not None, "triton": self.triton, "triton-coarse": self.triton}
        return [v for v in self.attention_variants if applies.get(v, True)]

    def _forward(self, bucket: int, span: int, attention: str) -> torch.Tensor:
        """The static step over the pool's first ``bucket`` rows and ``span`` key columns, its
        attention in form ``attention``: reads only ``self._inputs`` and the pool, returns float32
        logits (bucket, 1, vocab)."""
        if self.fused_elementwise:
            return self._forward_fused(bucket, span, attention)
        model, pool = self.model, self.pool
        ids, positions, columns, lengths, rows = self._step_inputs(bucket)
        x = model.embed(ids[:, None])  # (bucket, 1, hidden)
        cos = self._cos[positions][:, None, None, :]  # (bucket, 1, 1, rotary_dim)
        sin = self._sin[positions][:, None, None, :]
        for layer in model.layers:
            q, k, v = layer.attention_inputs(x, cos, sin)  # q (bucket, H, 1, D), k/v (bucket, Hkv, 1, D)
            keys, values = pool.keys[layer.self_attn.layer_idx], pool.values[layer.self_attn.layer_idx]
            keys[rows, :, columns] = k[:, :, 0]  # (bucket, Hkv, D): each row's new column (padding: scratch)
            values[rows, :, columns] = v[:, :, 0]
            attn = static_decode_attention(attention, q, keys[:bucket, :, :span], values[:bucket, :, :span], lengths)
            x = layer.attention_outputs(x, attn)  # (bucket, 1, hidden)
        return model.head(model.final_norm(x))  # (bucket, 1, vocab)

    def _step_inputs(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """The input block's rows for the first ``bucket`` pool rows, each (bucket,) int64: token
        ids, positions, columns, visible keys; and the pool rows themselves (0 .. bucket - 1)."""
        inputs = self._inputs[:, :bucket]
        return inputs[IDS], inputs[POSITIONS], inputs[COLUMNS], inputs[LENGTHS], self._row_index[:bucket]

    def _forward_fused(self, bucket: int, span: int, attention: str) -> torch.Tensor:
        """:meth:`_forward` with each layer's elementwise chain as three Triton kernels: the
        residual add and the next norm in one (:func:`~hybridllm.models.triton_fused.rms_norm`),
        rotary and the KV write in one, silu and the gate product in one."""
        from hybridllm.models.triton_fused import rms_norm, rotate_and_store, silu_and_mul

        model, pool = self.model, self.pool
        ids, positions, columns, lengths, rows = self._step_inputs(bucket)
        layers = model.layers
        normed, x = rms_norm(model.embed(ids[:, None]), layers[0].input_layernorm)  # (bucket, 1, hidden) each
        for i, layer in enumerate(layers):
            attn_module = layer.self_attn
            keys, values = pool.keys[attn_module.layer_idx], pool.values[attn_module.layer_idx]
            q = rotate_and_store(attn_module.qkv_proj(normed), self._cos, self._sin, positions, rows, columns,
                                 keys, values, attn_module.n_heads, attn_module.n_kv_heads)  # (bucket, H, 1, D)
            attn = static_decode_attention(attention, q, keys[:bucket, :, :span], values[:bucket, :, :span], lengths)
            normed, x = rms_norm(x, layer.post_attention_layernorm, residual=attn_module.output(attn))
            mlp_out = layer.mlp.down_proj(silu_and_mul(layer.mlp.gate_up_proj(normed)))  # (bucket, 1, hidden)
            following = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
            normed, x = rms_norm(x, following, residual=mlp_out)
        return model.head(normed)  # (bucket, 1, vocab)

    def _captured(self, bucket: int, span: int) -> CapturedStep:
        """The step of ``(bucket, span)`` as a CUDA graph, captured on first use: one graph per
        applicable attention form, each replayed :data:`TIMED_REPLAYS` times, the fastest kept.

        Warm-up, capture and timing run with every row padded, so their writes land in scratch
        columns.
        """
        captured = self._graphs.get((bucket, span))
        if captured is not None:
            return captured
        self._inputs[:, :bucket].copy_(self._padding[:, :bucket])
        candidates = [self._capture(bucket, span, variant) for variant in self._variants(span)]
        timings = {c.attention: self._replay_ms(c) for c in candidates} if len(candidates) > 1 else {}
        captured = min(candidates, key=lambda c: timings.get(c.attention, 0.0))
        self.attention_choice[(bucket, span)] = timings or {captured.attention: float("nan")}
        self._graphs[(bucket, span)] = captured
        return captured

    def _capture(self, bucket: int, span: int, attention: str) -> CapturedStep:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._forward(bucket, span, attention)  # lazy initialisations (cuBLAS handles) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool, stream=side):  # the warmed-up stream captures
            logits = self._forward(bucket, span, attention)
        current.wait_stream(side)
        return CapturedStep(graph, logits, attention)

    def _replay_ms(self, captured: CapturedStep) -> float:
        """Milliseconds of one replay of ``captured`` (the mean of :data:`TIMED_REPLAYS`, after one)."""
        captured.graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(TIMED_REPLAYS):
            captured.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / TIMED_REPLAYS
