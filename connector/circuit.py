"""A circuit breaker for daemon calls: one missed deadline, not one per call.

A daemon that is frozen (SIGSTOP, a stuck disk, an overloaded host) answers nothing, so
without a breaker every call waits out its full deadline: a scheduler pass that asks about
twenty requests waits twenty deadlines. After a call misses its deadline, or finds the daemon
unreachable, the breaker opens: every call is a miss at once, counted, until a background
probe (the standard health check, with a short deadline) gets an answer and closes it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

_FIRST_PROBE_S = 0.05
_MAX_PROBE_S = 1.0


class CircuitBreaker:
    """Closed (calls go out) or open (calls miss at once until ``probe`` succeeds)."""

    def __init__(self, probe: Callable[[], bool], name: str):
        self._probe = probe
        self._name = name
        self._lock = threading.Lock()
        self._open = False
        self._stopped = threading.Event()
        self.trips = 0
        """How many times the breaker opened."""
        self.short_circuited = 0
        """Calls answered as misses at once while it was open."""

    @property
    def is_open(self) -> bool:
        return self._open

    def allow(self) -> bool:
        """True if a call may go out now; counts the ones that may not."""
        if self._open:
            self.short_circuited += 1
            return False
        return True

    def trip(self, reason: str) -> None:
        """Opens the breaker (if closed) and starts probing for the daemon's return."""
        with self._lock:
            if self._open or self._stopped.is_set():
                return
            self._open = True
            self.trips += 1
        log.warning("kvtier daemon %s: %s; calls miss until it answers again", self._name, reason)
        threading.Thread(target=self._probe_until_closed, name="kvtier-probe", daemon=True).start()

    def close(self) -> None:
        """Closes the breaker: the daemon has just answered (a session opened), so calls
        need not wait for the next probe."""
        with self._lock:
            was_open, self._open = self._open, False
        if was_open:
            log.info("kvtier daemon %s answers again", self._name)

    def stop(self) -> None:
        self._stopped.set()

    def _probe_until_closed(self) -> None:
        wait = _FIRST_PROBE_S
        while not self._stopped.wait(wait):
            if not self._open:
                return  # closed meanwhile (a session opened)
            if self._probe():
                with self._lock:
                    self._open = False
                log.info("kvtier daemon %s answers again", self._name)
                return
            wait = min(wait * 2, _MAX_PROBE_S)
