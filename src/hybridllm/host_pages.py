"""2 MiB pages for the host buffers the kernels stream: the native weights.

A decode step reads every weight once, from memory; on 4 KiB pages each 4 KiB costs a TLB miss,
and in a virtual machine a miss walks two page tables. On the Intel Xeon KVM guest of
docs/benchmarks.md, two threads, ``torch.sum`` over 300 MiB buffers read 21-31 GB/s on 4 KiB
pages and 25-32 on 2 MiB ones side by side (``tools/bandwidth_probe.py --huge-pages odd``), a C
loop over float16 rows 18 against 24-29; a weight-bound decode step of Llama-3.2-1B took 2-9%
less time.

:func:`empty_on_huge_pages` asks for huge pages before a buffer is first written
(``MADV_HUGEPAGE``: its pages then fault in 2 MiB at a time); :func:`collapse` backs the whole
2 MiB pages of a range already written with huge pages (``MADV_COLLAPSE``, Linux 6.1+:
synchronous, a copy of each page that is not huge yet, whatever the system's transparent-hugepage
mode). Only whole pages inside a range are advised or collapsed, so no byte becomes resident that
would not have been. Anywhere else (another OS, an older kernel, no free huge page) nothing
happens and the buffers stay on 4 KiB pages: the same values either way, only the reads' speed
differs.

Not for the KV rows: a collapse costs 2-6 ms per page here (the kernel finds and fills a free
huge page), and collapsing a decode's KV pages as they filled put 0.2-0.85 s into single steps
(docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

HUGE_PAGE = 2 * 1024 * 1024
MADV_HUGEPAGE = 14  # linux/mman.h
MADV_COLLAPSE = 25  # linux/mman.h (Linux 6.1)


@functools.cache
def _madvise():
    """libc's ``madvise`` (None off Linux or without a C library)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def whole_pages(address: int, nbytes: int) -> tuple[int, int]:
    """(first, length): the whole 2 MiB pages inside ``[address, address + nbytes)`` (length 0: none)."""
    first = -(-address // HUGE_PAGE) * HUGE_PAGE
    last = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return first, max(0, last - first)


def _advise(address: int, nbytes: int, advice: int) -> int:
    """madvise(advice) over the whole 2 MiB pages of ``[address, address + nbytes)``; the bytes it
    took (0: none whole, or refused)."""
    first, length = whole_pages(address, nbytes)
    madvise = _madvise()
    if length == 0 or madvise is None:
        return 0
    return length if madvise(first, length, advice) == 0 else 0


def collapse(address: int, nbytes: int) -> int:
    """Back the whole 2 MiB pages of the written host range ``[address, address + nbytes)`` with
    huge pages; returns the bytes collapsed (0 where the kernel cannot). Pages already huge cost
    nothing; others a copy each."""
    return _advise(address, nbytes, MADV_COLLAPSE)


def empty_on_huge_pages(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of ``nbytes`` whose whole 2 MiB pages, where not yet
    touched, fault in as huge pages when first written (``MADV_HUGEPAGE``: no copy, unlike
    :func:`collapse`, which then finds them done)."""
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    _advise(tensor.data_ptr(), nbytes, MADV_HUGEPAGE)
    return tensor


def collapse_tensor(tensor: torch.Tensor) -> int:
    """:func:`collapse` over a written, contiguous CPU tensor's bytes (not for page-locked memory,
    whose pages cannot move)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    return collapse(tensor.data_ptr(), tensor.numel() * tensor.element_size())


__all__ = ["HUGE_PAGE", "collapse", "collapse_tensor", "empty_on_huge_pages", "whole_pages"]
