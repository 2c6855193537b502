"""The request loop's own thread: steps while there is work, sleeps on the loop's condition otherwise."""

from __future__ import annotations

import threading
from collections.abc import Callable

# How long the thread sleeps after a step that could run nothing (every running request paused by
# its consumer, the queue's head waiting for their KV) unless the condition wakes it first.
IDLE_RECHECK_S = 0.05


class LoopThread:
    """Runs ``step`` on a daemon thread whenever ``has_work()``; a step that raises is handed to
    ``on_error`` and the loop goes on (it never dies while serving). A step that ran nothing
    (every running request paused) is followed by a sleep on the condition, at most
    :data:`IDLE_RECHECK_S`, instead of another step at once.

    Args:
        cond: the loop's condition (notified when work arrives, changes or the loop must stop).
        has_work: whether anything is queued, running or waiting to be aborted.
        step: one iteration of the loop; returns whether sequences ran.
        on_error: what to do with a step's exception (fail what was running).
    """

    def __init__(self, cond: threading.Condition, has_work: Callable[[], bool], step: Callable[[], bool],
                 on_error: Callable[[Exception], None]) -> None:
        self.cond = cond
        self.has_work = has_work
        self.step = step
        self.on_error = on_error
        self.stopping = False
        self._thread: threading.Thread | None = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self.is_running:
            return
        self.stopping = False
        self._thread = threading.Thread(target=self._run, name="hybridllm-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Ask the thread to stop after its current step and wait for it (``stopping`` stays set
        until :meth:`stopped` says the loop's requests are ended)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def stopped(self) -> None:
        """The loop is stopped and its requests ended: new ones may be queued again."""
        self.stopping = False

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Run steps on the calling thread until there is no work (tests, tools); the steps run."""
        if self.is_running:
            raise RuntimeError("the loop thread is running; do not step from another thread")
        steps = 0
        while self.has_work() and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1
        return steps

    def _run(self) -> None:
        while True:
            with self.cond:
                while not (self.stopping or self.has_work()):
                    self.cond.wait()
                if self.stopping:
                    return
            try:
                ran = self.step()
            except Exception as exc:  # never let the loop die: fail what was running, keep serving
                self.on_error(exc)
                continue
            if not ran:  # nothing could run (only paused requests): sleep until something changes
                with self.cond:
                    if not self.stopping:
                        self.cond.wait(IDLE_RECHECK_S)
