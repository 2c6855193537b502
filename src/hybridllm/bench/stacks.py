"""Where a process was when it ran out of time: its Python stacks, asked for before the kill.

A measured process calls :func:`dump_stacks_on_signal` once; whoever times it out calls
:func:`ask_for_stacks` before killing it, and the process prints every thread's stack on its
standard error (``faulthandler``'s format, safe to print from a signal handler even while the
process is inside a C extension or a CUDA call). :func:`where` names the innermost frame of our
own code in the thread that was measuring, so a timeout row says "at kvcache/tiered.py:310 in
_attention_on_device" instead of nothing. POSIX only: elsewhere nothing is asked or printed.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import subprocess
import sys

STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # the signal that asks for the stacks (None: not on this OS)
STACK_WAIT_S = 2.0  # how long the stacks may take to be printed before the kill
PACKAGE = "hybridllm"
# faulthandler's lines: a thread's header, then its frames, most recent call first
_THREAD_HEADER = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+")
_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')


def dump_stacks_on_signal() -> None:
    """In the process to be watched: print every thread's stack on standard error on STACK_SIGNAL."""
    if STACK_SIGNAL is not None:
        faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)


def ask_for_stacks(proc: subprocess.Popen) -> None:
    """Send ``proc`` the stack signal (the caller then waits :data:`STACK_WAIT_S` for the output
    and kills it). A process that has already exited is left alone."""
    if STACK_SIGNAL is None or proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, STACK_SIGNAL)
    except ProcessLookupError:
        pass


def thread_stacks(text: str) -> list[list[tuple[str, int, str]]]:
    """The threads' stacks in ``text`` (faulthandler's output among other lines): per thread its
    frames (path, line, function), most recent first."""
    threads: list[list[tuple[str, int, str]]] = []
    frames: list[tuple[str, int, str]] | None = None
    for line in text.splitlines():
        if _THREAD_HEADER.match(line):
            frames = []
            threads.append(frames)
        elif frames is not None and (frame := _FRAME.match(line)):
            frames.append((frame["path"], int(frame["line"]), frame["function"]))
        else:
            frames = None  # the dump ended: later lines are the process's own output
    return threads


def _package_path(path: str) -> str | None:
    """``path`` relative to the package (``kvcache/tiered.py``), or None outside it."""
    parts = path.replace(os.sep, "/").split("/")
    if PACKAGE not in parts[:-1]:
        return None
    return "/".join(parts[len(parts) - 1 - parts[::-1].index(PACKAGE) + 1:])


def where(text: str, entry: str) -> str | None:
    """The innermost frame of the package in the thread whose stack passes through ``entry`` (a
    module path inside the package, e.g. ``bench/worker.py``), outside that module, as
    ``kvcache/tiered.py:310 in _attention_on_device``; None when the text holds no such stack."""
    for frames in thread_stacks(text):
        local = [(_package_path(path), line, function) for path, line, function in frames]
        if not any(path == entry for path, _, _ in local):
            continue
        for path, line, function in local:
            if path is not None and path != entry:
                return f"{path}:{line} in {function}"
        return None
    return None
