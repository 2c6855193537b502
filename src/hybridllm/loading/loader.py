"""Checkpoint -> a ready ``LlamaForCausalLM``: read, dequantize and place every weight, timed.

Each tensor goes through three timed phases: ``read`` (disk -> host RAM), ``dequantize``
(file format -> compute dtype) and ``to_device`` (host RAM -> the device ``device_for`` names
for that parameter). The checkpoint's separate q/k/v and gate/up projections are stacked into
the model's ``qkv_proj`` / ``gate_up_proj`` as soon as a layer's last part is read
(``hybridllm.loading.skeleton.ProjectionAssembler``), so the load's peak is the model plus
about one layer.
A progress bar shows on a terminal for files above 64 MiB.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hybridllm.loading.quantized_loader import HostLayout, load_quantized_model
from hybridllm.loading.skeleton import HEAD, ProjectionAssembler, load_tensors, prepare_skeleton, progress
from hybridllm.models.llama import LlamaForCausalLM
from hybridllm.timing import ColdStart, synchronize

EMBEDDING = "model.embed_tokens.weight"


def load_model(
    checkpoint,
    dtype: torch.dtype,
    device_for: Callable[[str], torch.device],
    cold_start: ColdStart | None = None,
    show_progress: bool | None = None,
    weights: str = "float",
    fuse: bool = True,
    host_layout: HostLayout | None = None,
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
        fuse: stack q/k/v and gate/up into one matrix each; False keeps the parts separate
            (the same layout, one kernel per part: ``hybridllm.models.fuse.ConcatLinear``).
        host_layout: how host weights are held when a kernel library reads them in place (the
            runtime passes the native kernels' layout when they run the host's layers; None:
            PyTorch's modules). See ``hybridllm.loading.quantized_loader.HostLayout``.
    """
    if weights != "float":
        return load_quantized_model(checkpoint, dtype, device_for, cold_start, show_progress, weights, fuse,
                                    host_layout)
    cold_start = cold_start if cold_start is not None else ColdStart()
    config = checkpoint.config
    skeleton = prepare_skeleton(checkpoint, show_progress)

    state: dict[str, torch.Tensor] = {}
    assembler = ProjectionAssembler(skeleton.model, skeleton.expected, fuse)
    with progress(skeleton.show_progress, skeleton.total, checkpoint.path.name) as advance:
        for file_name, param_name in skeleton.names.items():
            if param_name not in skeleton.expected:
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
            assembler.loaded(param_name, state, {})
            advance(nbytes)
    model = skeleton.model
    assembler.finish(state, {})
    if config.tie_word_embeddings:
        state[HEAD] = state[EMBEDDING]
    load_tensors(model, state)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
