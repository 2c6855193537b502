"""Moving KV between the host and device tiers: pinned buffers, a side stream, events.

Every CUDA-specific call of the KV caches sits in one of these small functions. On any other
device they degenerate to plain synchronous copies (events are ``None``), so every cache path
runs on a CPU-only machine, where the CPU stands in for the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Event = torch.cuda.Event | None
Stream = torch.cuda.Stream | None


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device, pin: bool = False) -> torch.Tensor:
    """Uninitialised storage; ``pin`` page-locks host memory when CUDA is there to use it."""
    pin = pin and device.type == "cpu" and torch.cuda.is_available()
    return torch.empty(tuple(shape), dtype=dtype, device=device, pin_memory=pin)


def side_stream(device: torch.device) -> Stream:
    """A second CUDA stream for copies that overlap compute (None off CUDA)."""
    return torch.cuda.Stream(device=device) if is_cuda(device) else None


def copy_async(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], stream: Stream) -> Event:
    """Copy each ``src`` into its ``dst`` on ``stream``, after all work already queued on the current stream.

    Waiting for the current stream first makes the copies safe against kernels still reading
    a ``dst`` and writes still landing in a ``src``. Returns the event that marks the copies
    done (pass it to :func:`wait`); without a stream they are done on return and the event is None.
    """
    if stream is None:
        for dst, src in pairs:
            dst.copy_(src)
        return None
    ready = torch.cuda.current_stream(stream.device).record_event()
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        done = stream.record_event()
    for dst, src in pairs:
        for tensor in (dst, src):
            if tensor.is_cuda:  # keep the caching allocator from reusing the memory before the copy ran
                tensor.record_stream(stream)
    return done


def wait(event: Event, device: torch.device) -> None:
    """Make the current stream of ``device`` wait for ``event`` (no-op for None)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def copy_ordered(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy on the current stream without blocking the host (the device orders later readers).

    Use only where the host itself never reads ``dst`` before a :func:`synchronize`.
    """
    dst.copy_(src, non_blocking=src.is_cuda or dst.is_cuda)


def to_host_async(tensor: torch.Tensor, host: torch.device) -> tuple[torch.Tensor, Event]:
    """Start copying ``tensor`` to ``host``; the host may read it after :func:`host_wait` on the event."""
    if not tensor.is_cuda:
        return tensor.to(host), None
    out = empty(tensor.shape, tensor.dtype, host, pin=True)
    out.copy_(tensor, non_blocking=True)
    return out, torch.cuda.current_stream(tensor.device).record_event()


def host_wait(event: Event) -> None:
    """Block the host until ``event`` has happened (no-op for None)."""
    if event is not None:
        event.synchronize()


def synchronize(device: torch.device) -> None:
    """Wait for every queued operation on ``device`` (no-op off CUDA)."""
    if is_cuda(device):
        torch.cuda.synchronize(device)
