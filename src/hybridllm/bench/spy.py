"""Where a running process spends its Python time, sampled by py-spy: per thread, the frames of
the project and its server stack that were running while the thread held the GIL.

The GPU runs measured 16 server streams at 4.9 ms per 16-row step against ~1.3 ms of device work
(docs/benchmarks.md, "GPU"): the rest is Python on the host, shared out by the GIL between the
request loop's thread and the event loop's. py-spy (a sampling profiler that attaches to a running
process) with ``--gil`` records only the thread that holds the GIL at each sample, so the samples
add up to the serial Python work and say whose it is.

    with Sampler(pid, out / "batched-1.raw") as sampler:   # py-spy record, stopped on exit
        ... the burst ...
    print(summarize(sampler.path))                       # the table, per thread

py-spy is not a dependency: :func:`find_py_spy` says where it is, or None (the GPU image has none;
a wheel is carried, docs/benchmarks.md says how).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

SAMPLE_RATE = 500  # samples per second
STOP_WAIT_S = 20.0  # py-spy writes its file after SIGINT: how long to wait for it
APP_FRAMES = ("hybridllm/", "starlette/", "uvicorn/", "fastapi/", "anyio/", "asyncio/", "torch/")
TOP = 25  # frames listed per thread


def find_py_spy() -> str | None:
    """The py-spy executable: beside this Python's interpreter, else on the PATH; None without one."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


class Sampler:
    """``py-spy record --gil --threads`` on ``pid`` while the ``with`` block runs, its raw
    (collapsed-stack) output written to ``path``; a no-op where py-spy is missing (``available``)."""

    def __init__(self, pid: int, path: Path, py_spy: str | None = None) -> None:
        self.pid = pid
        self.path = path
        self.py_spy = py_spy or find_py_spy()
        self.available = self.py_spy is not None
        self.error: str | None = None if self.available else "py-spy not found"
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> Sampler:
        if self.available:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._proc = subprocess.Popen(
                [self.py_spy, "record", "--pid", str(self.pid), "--rate", str(SAMPLE_RATE), "--format", "raw",
                 "--gil", "--threads", "--nonblocking", "--output", str(self.path)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # py-spy writes what it has, then exits
        try:
            _, err = proc.communicate(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if not self.path.exists():
            said = (err or "").strip().splitlines()
            self.error = said[-1] if said else "py-spy wrote nothing"


def frame_name(frame: str) -> str:
    """``function (path/to/file.py:line)`` -> ``function file.py:line``."""
    name, _, where = frame.partition(" (")
    return f"{name} {os.path.basename(where.rstrip(')'))}" if where else name


def summarize(raw: Path | str, top: int = TOP) -> str:
    """Per thread, its share of the samples and the innermost project/server frames it held the
    GIL in, from py-spy's raw output (``thread (tid): name;outer frame;...;inner frame count``; a
    thread without a name is ``thread (tid)``)."""
    per_thread: dict[str, Counter[str]] = {}
    totals: Counter[str] = Counter()
    for line in Path(raw).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0].split(":", 1)[-1].strip() if frames[0].startswith("thread") else "?"
        app = [f for f in frames[1:] if any(marker in f for marker in APP_FRAMES)]
        if app:
            key = " < ".join(frame_name(f) for f in reversed(app[-3:]))  # innermost first
        else:
            key = frame_name(frames[-1]) if len(frames) > 1 else "(no Python frame)"
        per_thread.setdefault(thread, Counter())[key] += int(count)
        totals[thread] += int(count)
    everything = sum(totals.values())
    if not everything:
        return "no samples\n"
    lines = [f"{everything} samples with the GIL held, at {SAMPLE_RATE}/s "
             f"({everything / SAMPLE_RATE:.2f} s of Python)"]
    for thread, total in totals.most_common():
        lines.append(f"\n## {thread}: {total} samples ({100 * total / everything:.0f} %)")
        lines += [f"{count:6d}  {key}" for key, count in per_thread[thread].most_common(top)]
    return "\n".join(lines) + "\n"
