"""The native backend: decode steps of host layers through the C++ kernels (``hybridllm.kernels``).

Built once per model (:func:`hybridllm.kernels.native.build_native_steps`): a native step per
CPU-resident float32 layer with stacked projections, the head, and the whole token in one call
when every layer and the head are native; then a prefill chunk of one sequence also runs in one
call (``hl_prefill_model``). Host int4 layers are held once, in the kernels' block layout. Each
step runs natively only where it applies (one token per row, float32 activations on the CPU,
each row's cache writable in place; a batch of rows runs in one call, each row's logits bitwise
as alone); otherwise that step runs the layer's PyTorch code, exactly as the eager backend would.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hybridllm.kernels.native import build_native_steps
from hybridllm.kvcache.base import KVCache
from hybridllm.models.llama import DecoderLayer, LlamaForCausalLM
from hybridllm.runtime.backends.base import BackendReport
from hybridllm.runtime.backends.eager import EagerBackend


class NativeBackend(EagerBackend):
    """Native host kernels where they apply, the model's PyTorch code elsewhere.

    Raises :class:`hybridllm.kernels.build.KernelBuildError` when the kernels cannot be built.
    """

    name = "native"

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__(model)
        self.steps = build_native_steps(model)
        built = self.steps.report
        self.report = BackendReport(kernel_layers=built.layers, head=built.head, whole_step=built.whole_step,
                                    build_seconds=built.build_seconds,
                                    skipped=list(built.skipped))
        if built.layers == 0:
            self.report.notes.append("native decode: no host layer got a native step (reasons in skipped)")

    def token_step(self, input_ids: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache) -> torch.Tensor | None:
        whole = self.steps.whole
        if whole is None or not whole.applies(input_ids, x, cache):
            return None
        return whole.decode(x, cos, sin, cache)

    def prefill_step(self, input_ids: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     cache: KVCache, all_logits: bool) -> torch.Tensor | None:
        whole = self.steps.whole
        if whole is None or not whole.applies_prefill(input_ids, x, cache):
            return None
        return whole.prefill(x, cos, sin, cache, all_logits)

    def chunks_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[KVCache],
                    lengths: list[int]) -> torch.Tensor | None:
        whole = self.steps.whole
        if whole is None or not whole.applies_chunks(x, caches):
            return None
        return whole.prefill_chunks(x.reshape(-1, x.shape[-1]), cos, sin, caches, lengths)

    @contextmanager
    def glue(self) -> Iterator[None]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # PyTorch's workers stay asleep: the kernels' team gets the cores
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def layer_step(self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache) -> torch.Tensor:
        native = self.steps.layers.get(layer.self_attn.layer_idx)
        if native is not None and native.applies(x, cos, cache):
            return native.step(x, cos, sin, cache)  # the whole one-token step in one kernel call
        return layer(x, cos, sin, cache)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        native = self.steps.head
        if native is not None and native.applies(x):
            return native(x)
        return self.model.head(x)
