"""A circuit breaker for daemon calls: one missed deadline, not one per call.

A daemon that is frozen (SIGSTOP, a stuck disk, an overloaded host) answers nothing, so
without a breaker every call waits out its full deadline: a scheduler pass that asks about
twenty requests waits twenty deadlines. After a call misses its deadline, or finds the daemon
unreachable, the breaker opens: every call is a miss at once, counted, until a background
probe (the standard health check, with a short deadline) gets an answer and closes it.

Every client of one daemon in a process shares one breaker (``shared_breaker``): vLLM's
scheduler and its worker each hold a client, and a frozen daemon should cost the engine one
deadline, not one per client.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.connector.tunables import TUNABLES

log = logging.getLogger(__name__)


class CircuitBreaker:
    """Closed (calls go out) or open (calls miss at once until a probe succeeds)."""

    def __init__(self, name: str):
        self._probes: list[Callable[[], bool]] = []
        self._tripped: list[Callable[[], None]] = []
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

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

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
        with self._lock:
            listeners = list(self._tripped)
        for tripped in listeners:
            tripped()

    def close(self) -> None:
        """Closes the breaker: the daemon has just answered (a session opened), so calls
        need not wait for the next probe."""
        with self._lock:
            was_open, self._open = self._open, False
        if was_open:
            log.info("kvtier daemon %s answers again", self._name)

    def stop(self) -> None:
        self._stopped.set()

    def attach(self, probe: Callable[[], bool], tripped: Callable[[], None]) -> None:
        """Adds a client: its probe (the newest one probes; the others may be closing) and
        what it does when the breaker opens (ends the calls it is still waiting on)."""
        with self._lock:
            self._probes.append(probe)
            self._tripped.append(tripped)

    def detach(self, probe: Callable[[], bool], tripped: Callable[[], None]) -> bool:
        """Removes a client; True if none is left."""
        with self._lock:
            for listed, item in ((self._probes, probe), (self._tripped, tripped)):
                if item in listed:
                    listed.remove(item)
            return not self._probes

    def _probe(self) -> bool:
        with self._lock:
            probe = self._probes[-1] if self._probes else None
        return probe is not None and probe()

    def _probe_until_closed(self) -> None:
        wait = TUNABLES.first_probe_s
        while not self._stopped.wait(wait):
            if not self._open:
                return  # closed meanwhile (a session opened)
            if self._probe():
                with self._lock:
                    self._open = False
                log.info("kvtier daemon %s answers again", self._name)
                return
            wait = min(wait * 2, TUNABLES.max_probe_s)


_shared: dict[str, CircuitBreaker] = {}
_shared_lock = threading.Lock()


def _forget_shared() -> None:
    """A forked child's clients are its own: it starts with no shared breaker."""
    global _shared_lock
    _shared.clear()
    _shared_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_shared)


def shared_breaker(
    target: str, probe: Callable[[], bool], tripped: Callable[[], None]
) -> CircuitBreaker:
    """The breaker of every client of ``target`` in this process, with a client attached
    (see ``CircuitBreaker.attach``); give it back with ``leave_breaker``."""
    with _shared_lock:
        breaker = _shared.get(target)
        if breaker is None or breaker.stopped:
            breaker = _shared[target] = CircuitBreaker(target)
        breaker.attach(probe, tripped)
        return breaker


def leave_breaker(
    target: str, breaker: CircuitBreaker, probe: Callable[[], bool], tripped: Callable[[], None]
) -> None:
    """Detaches a closing client; the last client to leave stops the breaker."""
    with _shared_lock:
        if breaker.detach(probe, tripped):
            breaker.stop()
            if _shared.get(target) is breaker:
                del _shared[target]


def health_probe(channel: grpc.Channel, timeout_s: float, metadata) -> Callable[[], bool]:
    """A breaker's probe: whether the daemon answers its standard health check now."""
    check = health_pb2_grpc.HealthStub(channel).Check

    def probe() -> bool:
        try:
            reply = check(health_pb2.HealthCheckRequest(), timeout=timeout_s, metadata=metadata)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    return probe
