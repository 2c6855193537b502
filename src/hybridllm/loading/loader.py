"""Checkpoint -> a ready ``LlamaForCausalLM``: read, dequantize and place every weight, timed.

Each tensor goes through three timed phases: ``read`` (disk -> host RAM), ``dequantize``
(file format -> compute dtype) and ``to_device`` (host RAM -> the device ``device_for`` names
for that parameter). A progress bar shows on a terminal for files above 64 MiB.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from hybridllm.errors import ModelLoadError
from hybridllm.models.layers import RotaryEmbedding
from hybridllm.models.llama import LlamaForCausalLM
from hybridllm.timing import ColdStart, synchronize

PROGRESS_MIN_BYTES = 64 * 2**20


def load_model(
    checkpoint,
    dtype: torch.dtype,
    device_for: Callable[[str], torch.device],
    cold_start: ColdStart | None = None,
    show_progress: bool | None = None,
    weights: str = "float",
) -> LlamaForCausalLM:
    """Build the model of ``checkpoint`` with every parameter on ``device_for(name)`` in ``dtype``.

    Args:
        checkpoint: a ``GGUFCheckpoint`` or ``HFCheckpoint``.
        dtype: compute dtype of the weights.
        device_for: parameter name (Hugging Face naming) -> device that holds it.
        cold_start: receives the phase timings.
        show_progress: force the progress bar on/off (default: on a terminal, for large files).
        weights: "float" dequantizes every weight to ``dtype``; "auto", "int8" and "int4" keep
            matrices quantized (see ``hybridllm.loading.quantized_loader``).
    """
    if weights != "float":
        from hybridllm.loading.quantized_loader import load_quantized_model

        return load_quantized_model(checkpoint, dtype, device_for, cold_start, show_progress, weights)
    cold_start = cold_start if cold_start is not None else ColdStart()
    config = checkpoint.config
    model, expected, names, show_progress, total = prepare_skeleton(checkpoint, show_progress)

    state: dict[str, torch.Tensor] = {}
    with _progress(show_progress, total, checkpoint.path.name) as advance:
        for file_name, param_name in names.items():
            if param_name not in expected:
                continue  # e.g. lm_head.weight stored although tied
            t0 = time.perf_counter()
            raw = checkpoint.read(file_name)
            t1 = time.perf_counter()
            tensor = checkpoint.dequantize(file_name, raw).to(dtype)
            t2 = time.perf_counter()
            device = device_for(param_name)
            tensor = tensor.to(device)
            synchronize(device)
            t3 = time.perf_counter()
            cold_start.read_s += t1 - t0
            cold_start.dequantize_s += t2 - t1
            cold_start.to_device_s += t3 - t2
            nbytes = checkpoint.nbytes(file_name)
            cold_start.bytes_read += nbytes
            state[param_name] = tensor
            advance(nbytes)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = RotaryEmbedding(config)  # buffers were built on the meta device
    return model.eval()


def prepare_skeleton(checkpoint, show_progress: bool | None):
    """The model on the meta device, the parameter names to fill, the file's name map, whether
    to show a progress bar, and the bytes to read. Raises ModelLoadError when weights are missing."""
    config = checkpoint.config
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name for name, _ in model.named_parameters()}
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    names = checkpoint.parameter_names()  # file name -> parameter name
    missing = expected - set(names.values())
    if missing:
        raise ModelLoadError(f"{checkpoint.path}: missing weights, e.g. {sorted(missing)[0]}")
    total = sum(checkpoint.nbytes(n) for n in names)
    if show_progress is None:
        show_progress = total >= PROGRESS_MIN_BYTES and sys.stderr.isatty()
    return model, expected, names, show_progress, total


class _progress:
    """Context manager yielding an ``advance(nbytes)`` callback; a rich bar when enabled."""

    def __init__(self, enabled: bool, total: int, label: str) -> None:
        self.enabled, self.total, self.label = enabled, total, label
        self._bar = None

    def __enter__(self) -> Callable[[int], None]:
        if not self.enabled:
            return lambda _n: None
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

        self._bar = Progress(
            TextColumn("loading {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), transient=True,
        )
        self._bar.start()
        task = self._bar.add_task(self.label, total=self.total)
        return lambda n: self._bar.update(task, advance=n)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
