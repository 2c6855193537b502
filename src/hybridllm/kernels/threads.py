"""How many threads a native decode step uses, and how its threads wait, picked at run time.

    policy = ThreadPolicy()              # one per model's native steps
    team = policy.team(requested=2)      # TeamChoice(threads, spins), re-decided every 0.5 s

A decode step's threads meet at ~10 barriers per layer. When another process keeps one of the
cores busy, the thread that shares that core runs only in the scheduler's time slices, and every
barrier waits for it: 2-thread decode fell to 1.5% of its idle speed with a busy loop pinned to
one core (spinning waiters made it worse by keeping their own core busy). So:

- the kernels' own thread team spins briefly and then sleeps at a barrier (``decode.cpp``,
  ``hl_set_spin_wait``), and
- :class:`ThreadPolicy` watches how much of the CPUs this process may use is busy with *other*
  work (``/proc/stat`` busy time minus this process's own CPU time, over the time between two
  decisions) and gives a decode step only the cores that are free (:func:`choose_team`).

A step's results do not depend on its thread count (the kernels split work by sizes only), so
changing it never changes an answer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

SPIN_FREE = 20_000  # pauses before sleeping when the cores are free (~0.1 ms: barriers are ~10 us apart)
SPIN_SHARED = 2_000  # when other work shares the cores: give a taken core back sooner
# A core counts as free while other work keeps it busy less than half the time (a burst of other
# work in the last window, such as a client sending its requests, does not halve the team).
FREE_MARGIN = 0.5
DECIDE_EVERY_S = 0.5
_PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class TeamChoice:
    """Threads for a decode step and how long a waiting thread spins before it sleeps."""

    threads: int
    spins: int


def choose_team(requested: int, cpus: int, busy_elsewhere: float) -> TeamChoice:
    """The team for a decode step.

    Args:
        requested: the thread count asked for (``--threads``; PyTorch's thread count).
        cpus: CPUs this process may run on.
        busy_elsewhere: cores' worth of CPU time other processes used lately (0 .. cpus).
    Returns:
        At most ``requested`` threads and at most the free cores (at least one); short spins when
        other work shares the cores.
    """
    free = cpus - max(0.0, busy_elsewhere)
    threads = max(1, min(requested, cpus, int(free + FREE_MARGIN)))
    spins = SPIN_FREE if busy_elsewhere < FREE_MARGIN else SPIN_SHARED
    return TeamChoice(threads, spins)


@dataclass(frozen=True)
class CpuSample:
    """CPU time at one instant: of the CPUs this process may use (all processes), and its own."""

    seconds: float  # monotonic clock
    busy: float  # busy seconds of the CPUs (user, nice, system, irq, softirq, steal)
    own: float  # this process's CPU seconds (all its threads)


def usable_cpus() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def read_sample(cpus: set[int]) -> CpuSample | None:
    """Busy time of ``cpus`` from ``/proc/stat`` and this process's CPU time; None where there
    is no ``/proc/stat`` (then the requested thread count is used as is)."""
    try:
        lines = _PROC_STAT.read_text().splitlines()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        if int(name[3:]) not in cpus:
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
        busy += user + nice + system + irq + softirq + steal
    return CpuSample(time.monotonic(), busy / tick, time.process_time())


def busy_elsewhere(before: CpuSample, after: CpuSample) -> float:
    """Cores' worth of CPU time other processes used between two samples."""
    elapsed = after.seconds - before.seconds
    if elapsed <= 0:
        return 0.0
    return max(0.0, ((after.busy - before.busy) - (after.own - before.own)) / elapsed)


class ThreadPolicy:
    """Re-decides the decode team at most every ``every_s`` seconds from the CPU time used since
    the last decision (no waiting: the window is the time between two decode steps' checks).

    Args:
        every_s: seconds between decisions.
        cpus: the CPUs to watch (default: the ones this process may use).
    """

    def __init__(self, every_s: float = DECIDE_EVERY_S, cpus: set[int] | None = None) -> None:
        self.every_s = every_s
        self.cpus = cpus if cpus is not None else usable_cpus()
        self.busy_elsewhere = 0.0
        self._last = read_sample(self.cpus)

    def team(self, requested: int) -> TeamChoice:
        """The team for the next decode step of ``requested`` threads at most."""
        now = time.monotonic()
        if self._last is not None and now - self._last.seconds >= self.every_s:
            sample = read_sample(self.cpus)
            if sample is not None:
                self.busy_elsewhere = busy_elsewhere(self._last, sample)
                self._last = sample
        return choose_team(requested, len(self.cpus), self.busy_elsewhere)


class FixedTeam:
    """A policy that always gives a step the requested threads, spinning as on a free machine
    (for benchmarks that compare kernels rather than the machine's load)."""

    busy_elsewhere = 0.0

    def team(self, requested: int) -> TeamChoice:
        return TeamChoice(max(1, requested), SPIN_FREE)


@dataclass(frozen=True)
class MachineLoad:
    """How busy the machine is with other work (for ``doctor`` and the bench output)."""

    cpus: int
    busy_elsewhere: float  # cores' worth, measured over a short window
    load_average: float | None  # 1-minute load average (every process, this one included)

    @property
    def loaded(self) -> bool:
        """Whether other work keeps more than a small share of a core busy."""
        return self.busy_elsewhere >= FREE_MARGIN

    @property
    def decode_threads(self) -> int:
        """Threads a decode step asking for every CPU would get now."""
        return choose_team(self.cpus, self.cpus, self.busy_elsewhere).threads

    def line(self) -> str:
        """One line: the figures, and what they mean for decode."""
        load = "" if self.load_average is None else f", load average {self.load_average:.2f}"
        state = (f"loaded: decode runs {self.decode_threads} thread(s), figures measured now are low"
                 if self.loaded else "not loaded")
        return f"{self.cpus} CPUs usable, {self.busy_elsewhere:.2f} cores busy with other work{load} ({state})"


def measure_machine_load(window_s: float = 0.25) -> MachineLoad:
    """Other work's share of this process's CPUs over ``window_s`` seconds (sleeps that long)."""
    cpus = usable_cpus()
    before = read_sample(cpus)
    time.sleep(window_s)
    after = read_sample(cpus)
    busy = 0.0 if before is None or after is None else busy_elsewhere(before, after)
    try:
        load_average = os.getloadavg()[0]
    except (AttributeError, OSError):
        load_average = None
    return MachineLoad(len(cpus), busy, load_average)


__all__ = ["FixedTeam", "MachineLoad", "TeamChoice", "ThreadPolicy", "choose_team", "measure_machine_load"]
