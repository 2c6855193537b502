"""Decode backends by name. Adding one (say ``cuda-graph``) is one module with a class that
follows :class:`~hybridllm.runtime.backends.base.DecodeBackend` (constructed from the placed
model, :class:`~hybridllm.runtime.placed_model.PlacedModel`) plus one line in :data:`BACKENDS`."""

from __future__ import annotations

from collections.abc import Callable

from hybridllm.errors import ConfigError
from hybridllm.runtime.backends.base import BackendReport, DecodeBackend
from hybridllm.runtime.backends.compiled import CompiledBackend
from hybridllm.runtime.backends.cuda_graph import CudaGraphBackend
from hybridllm.runtime.backends.eager import EagerBackend
from hybridllm.runtime.backends.native import NativeBackend
from hybridllm.runtime.placed_model import PlacedModel

BACKENDS: dict[str, Callable[[PlacedModel], DecodeBackend]] = {
    "eager": EagerBackend,
    "compiled": CompiledBackend,
    "native": NativeBackend,
    "cuda-graph": CudaGraphBackend,
}
AUTO = "auto"


def backend_class(name: str) -> Callable[[PlacedModel], DecodeBackend]:
    """The backend registered as ``name``; ConfigError naming the choices otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        choices = ", ".join([AUTO, *BACKENDS])
        raise ConfigError(f"unknown decode backend {name!r}; choose one of: {choices}") from None


def check_backend_name(name: str) -> str:
    """``name`` if it is "auto" or a registered backend; ConfigError naming the choices otherwise."""
    if name != AUTO:
        backend_class(name)
    return name


__all__ = ["AUTO", "BACKENDS", "BackendReport", "DecodeBackend", "backend_class", "check_backend_name"]
