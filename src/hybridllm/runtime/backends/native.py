"""The native backend: forwards of host layers through the C++ kernels (``hybridllm.kernels``).

Built once per model (:func:`hybridllm.kernels.native.build_native_steps`): a native step per
CPU-resident float32 layer with stacked projections, the head, and the whole model in one call
when every layer and the head are native. Host int4 layers are held once, in the kernels' block
layout. A step's rows whose caches can be written in place go to the whole-model kernels: every
one-token row in one ``hl_decode_model`` call (``NativeModel.decode``), every longer row (a
prefill chunk, several generated tokens) as a segment of one ``hl_prefill_model`` call
(``NativeModel.prefill_chunks``; rows that want every position's logits in a call of their own,
which the step's one-token rows join when there is one: speculative decoding's verification rows
and the other sequences' decode rows then read the weights once).
Each row's arithmetic is its own (batch-invariant kernels): its logits and KV are bitwise those
of its forward alone. The other rows walk the layers (:class:`EagerBackend`), each native layer's
one-token step through ``hl_decode_layer`` and the head's one-row product through ``hl_linear``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from hybridllm.kernels.native import NativeModel, build_native_steps
from hybridllm.kvcache.base import KVCache
from hybridllm.kvcache.batch import BatchedCaches
from hybridllm.models.llama import DecoderLayer
from hybridllm.runtime.backends.base import BackendReport
from hybridllm.runtime.backends.eager import EagerBackend
from hybridllm.runtime.forward_batch import ForwardBatch, ForwardRow, one_token_inputs
from hybridllm.runtime.placed_model import PlacedModel


class NativeBackend(EagerBackend):
    """Native host kernels where they apply, the model's PyTorch code elsewhere.

    Raises :class:`hybridllm.kernels.build.KernelBuildError` when the kernels cannot be built.
    """

    name = "native"

    def __init__(self, placed: PlacedModel) -> None:
        super().__init__(placed)
        self.steps = build_native_steps(self.model)
        built = self.steps.report
        self.report = BackendReport(kernel_layers=built.layers, head=built.head, whole_step=built.whole_step,
                                    build_seconds=built.build_seconds,
                                    skipped=list(built.skipped))
        if built.layers == 0:
            self.report.notes.append("native decode: no host layer got a native step (reasons in skipped)")
        embedding = self.model.model.embed_tokens.weight
        # the whole-model kernels read float32 embeddings from host memory
        self.whole: NativeModel | None = self.steps.whole if embedding.device.type == "cpu" else None

    def step(self, batch: ForwardBatch) -> list[torch.Tensor]:
        whole, rows = self.whole, batch.rows
        if whole is None:
            return self.walk_rows(rows)
        out: list[torch.Tensor | None] = [None] * len(rows)
        in_place = [row.cache.supports_in_place_layers(whole.layer_indices) for row in rows]
        # one-token rows join the step's rows of several tokens that want every position's logits
        # (speculative decoding's verification rows) as one-token segments of that call: the same bits
        # as a decode step (the kernels' one arithmetic per row), and the weights read once for both
        verifying = any(in_place[i] and row.n_tokens > 1 and row.all_logits for i, row in enumerate(rows))
        tokens = [i for i, row in enumerate(rows) if in_place[i] and row.n_tokens == 1 and not verifying]
        if tokens:
            for i, logits in zip(tokens, self._decode(whole, [rows[i] for i in tokens])):
                out[i] = logits
        for all_logits in (False, True):
            chunks = [i for i, row in enumerate(rows) if in_place[i] and out[i] is None
                      and (row.all_logits if row.n_tokens > 1 else verifying) == all_logits]
            if chunks:
                for i, logits in zip(chunks, self._prefill(whole, [rows[i] for i in chunks], all_logits)):
                    out[i] = logits
        rest = [i for i in range(len(rows)) if out[i] is None]
        if rest:
            for i, logits in zip(rest, self.walk_rows([rows[i] for i in rest])):
                out[i] = logits
        return out

    def _decode(self, whole: NativeModel, rows: Sequence[ForwardRow]) -> list[torch.Tensor]:
        """One-token rows in one ``hl_decode_model`` call: each row's logits (1, vocab)."""
        ids, cache, start = one_token_inputs(rows)
        with self.glue():
            x = self.model.embed(ids)  # (B, 1, hidden)
            cos, sin = self.model.rotary_tables(start, 1, x.dtype, x.device)  # (B or 1, 1, 1, D)
        logits = whole.decode(x, cos, sin, cache)  # (B, 1, vocab)
        self.placed.count_whole_forward(x.shape[-1] * x.element_size(), len(rows), len(rows))
        return list(logits)

    def _prefill(self, whole: NativeModel, rows: Sequence[ForwardRow], all_logits: bool) -> list[torch.Tensor]:
        """Rows of several tokens as the segments of one ``hl_prefill_model`` call: each row's
        logits (T or 1, vocab)."""
        lengths = [row.n_tokens for row in rows]
        ids = torch.tensor([[t for row in rows for t in row.token_ids]], dtype=torch.long)  # (1, rows)
        with self.glue():
            x = self.model.embed(ids)  # (1, rows, hidden)
            # each segment's positions with its own rotary set (longrope: by its own length)
            tables = [self.model.rotary_tables(row.start, row.n_tokens, x.dtype, x.device) for row in rows]
            cos = torch.cat([c.reshape(-1, c.shape[-1]) for c, _ in tables])  # (rows, D)
            sin = torch.cat([s.reshape(-1, s.shape[-1]) for _, s in tables])
        caches = [row.cache for row in rows]
        logits = whole.prefill_chunks(x.reshape(-1, x.shape[-1]), cos, sin, caches, lengths, all_logits)
        self.placed.count_whole_forward(x.shape[-1] * x.element_size(), int(ids.shape[1]), logits.shape[0])
        if all_logits:
            return list(logits.split(lengths))  # (T_i, vocab) each
        return list(logits[:, None])  # (1, vocab) each

    @contextmanager
    def glue(self) -> Iterator[None]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # PyTorch's workers stay asleep: the kernels' team gets the cores
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def layer_step(self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache | BatchedCaches) -> torch.Tensor:
        native = self.steps.layers.get(layer.self_attn.layer_idx)
        if native is not None and native.applies(x, cos, cache):
            return native.step(x, cos, sin, cache)  # the whole one-token step in one kernel call
        return layer(x, cos, sin, cache)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        native = self.steps.head
        if native is not None and native.applies(x):
            return native(x)
        return self.model.head(x)
