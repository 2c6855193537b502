"""Speed transforms of a loaded model: fused projections, native host decode kernels, and an
optional ``torch.compile``.

    model = apply_speed_transforms(model, fuse=True, native_decode=True, compile=False)
    model.speed_report  # what was applied and how long it took (seconds, for the cold start)

Fusion (``hybridllm.models.fuse``) changes no result beyond the kernels' summation order. It
runs per layer on each layer's own device, so call it after the placement moved the layers.
Native decode (``hybridllm.kernels.native``) gives host layers a one-call C++ decode step; when
the kernels cannot be built (no C++ compiler), the model keeps its PyTorch steps and the report
says why.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from hybridllm.kernels.build import KernelBuildError
from hybridllm.kernels.native import NativeReport, enable_native_decode
from hybridllm.models.fuse import fuse_projections
from hybridllm.models.llama import DecoderLayer

logger = logging.getLogger(__name__)


@dataclass
class SpeedReport:
    """What :func:`apply_speed_transforms` did; ``seconds`` belongs in the cold-start figures."""

    fused: bool = False
    compiled: bool = False
    native: NativeReport | None = None  # None: native decode not asked for, or not available
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def apply_speed_transforms(model: nn.Module, *, fuse: bool = True, native_decode: bool = True,
                           compile: bool = False) -> nn.Module:
    """Apply the speed transforms in place and return the model (with ``model.speed_report``).

    Args:
        model: a loaded ``LlamaForCausalLM`` (weights already on their devices).
        fuse: stack q/k/v and gate/up into one projection each (float, int4 and int8 layers).
        native_decode: give every fused float32 host layer and the head a native C++ decode step
            (:func:`hybridllm.kernels.native.enable_native_decode`; with ``fuse=False`` only the
            head gets one).
        compile: compile the layers' dense parts with ``torch.compile`` (see
            :func:`compile_layers`); the first forward of each new shape then pays the compile.
    """
    t0 = time.perf_counter()
    report = SpeedReport()
    if fuse:
        fuse_projections(model)
        report.fused = True
    if native_decode:
        try:
            report.native = enable_native_decode(model)
        except KernelBuildError as exc:
            logger.warning("native decode kernels unavailable, using PyTorch decode steps: %s", exc)
            report.notes.append(f"native decode unavailable: {exc}")
        else:
            if report.native.layers == 0:
                report.notes.append("native decode: no host layer got a native step (reasons in native.skipped)")
    if compile:
        compile_layers(model)
        report.compiled = True
        report.notes.append("compiled lazily: the first decode step pays the compile time")
    report.seconds = time.perf_counter() - t0
    model.speed_report = report
    return model


def compile_layers(model: nn.Module) -> nn.Module:
    """Compile the dense halves of every decoder layer's decode step (CPU inductor / CUDA).

    A decode step of a layer runs as: graph 1 (norm, q/k/v projection, rotary), the cache's
    ``attend`` (eager: Python bookkeeping, possibly other devices), graph 2 (output projection,
    residual, norm, MLP, residual). The two compiled functions are shared by all layers (the
    layer is an argument, its weights are graph inputs), so one compilation serves the model;
    prefill chunks (T > 1) stay eager. Compilation happens on the first decode step.
    """
    before = torch.compile(DecoderLayer.attention_inputs, fullgraph=True)
    after = torch.compile(DecoderLayer.attention_outputs, fullgraph=True)
    for layer in model.model.layers:
        layer.compiled_halves = (before, after)
    return model
