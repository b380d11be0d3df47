"""The serving loop's clocks: real time, or the time the engine itself spends.

On a machine other processes share, wall time measures them as much as the engine: a step
preempted halfway takes twice as long, and one arm can run in a quiet minute and the next in a
busy one. ``EngineClock`` counts instead what the engine thread spends: its CPU time while it
computes (one torch thread computes on the calling thread, so this is all of it), and wall time
while it admits requests, where it may wait on a read from the disk tier. Time the engine sits
idle is skipped to the next arrival, as if slept through. ``WallClock`` is real time; a GPU
needs it, since its kernels run on no CPU thread.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Seconds since the run's start; the loop brackets each part of a step with ``mark`` and
    ``lap``, which returns the part's duration and moves the clock past it."""

    name: str
    takes_turns: bool
    """Whether runs on such clocks may take turns on one thread (the time of one is not the
    time of another)."""

    def now(self) -> float: ...

    def wait_until(self, t: float) -> None: ...

    def mark(self) -> tuple[float, float]: ...

    def lap(self, mark: tuple[float, float], *, waits: bool) -> float: ...


class WallClock:
    """Real time: a step takes what it takes, idle time is slept through."""

    name = "wall"
    takes_turns = False

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._start

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))

    def mark(self) -> tuple[float, float]:
        return (time.perf_counter(), 0.0)

    def lap(self, mark: tuple[float, float], *, waits: bool) -> float:
        """Real time has passed by itself; ``waits`` makes no difference to it."""
        return time.perf_counter() - mark[0]


class EngineClock:
    """The engine thread's time: CPU time computing, wall time where it ``waits``."""

    name = "engine"
    takes_turns = True

    def __init__(self) -> None:
        self._t = 0.0

    def now(self) -> float:
        return self._t

    def wait_until(self, t: float) -> None:
        self._t = max(self._t, t)

    def mark(self) -> tuple[float, float]:
        return (time.perf_counter(), time.thread_time())

    def lap(self, mark: tuple[float, float], *, waits: bool) -> float:
        wall, cpu = mark
        elapsed = time.perf_counter() - wall if waits else time.thread_time() - cpu
        self._t += elapsed
        return elapsed


CLOCKS = {"wall": WallClock, "engine": EngineClock}
