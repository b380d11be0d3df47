"""The remote tier's routes: a few worker threads and a circuit breaker per store endpoint.

Calls to one endpoint run on that endpoint's own threads (as many as it has connections), so a
slow node ties up only its own; ``fan_out`` runs one batch over every endpoint at once and waits
at most its timeout. Each route's breaker counts consecutive failed calls (errors and
timeouts alike); at ``failures_to_open`` it opens and the route's keys are misses at once, with
no call made. A probe thread pings every open route each ``probe_interval_s`` (on the route's
threads, within the lookup deadline) and closes the breaker of one that answers in time; a
route the backend says is gone (the cluster moved its slots elsewhere) is forgotten. A call
that timed out may still be running: ``Borrow`` keeps it off the caller's buffers from then
on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.remote.backend import RemoteBackend, RemoteError, RouteGone

log = logging.getLogger(__name__)


class Borrow:
    """Reads and writes of a caller's buffers by a call's workers, stopped when it answers.

    A worker touches them only between ``begin()`` (False once the call has answered) and
    ``end()``; ``close()`` forbids new uses and waits for those under way (a copy of one block,
    or a send that ends at the latest on its socket timeout).
    """

    __slots__ = ("_active", "_closed", "_cond")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._closed = False

    def begin(self) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._active += 1
            return True

    def end(self) -> None:
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: not self._active)


class _Route:
    __slots__ = ("executor", "failures", "name", "open")

    def __init__(self, name: str, threads: int) -> None:
        self.name = name
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix=f"kvtier-remote-{name}")
        self.failures = 0
        self.open = False


class Routes:
    """The routes of one backend; counts breaker trips in ``counters`` under ``lock``."""

    def __init__(
        self,
        backend: RemoteBackend,
        counters: TierCounters,
        lock: threading.Lock,
        *,
        threads: int,
        failures_to_open: int,
        probe_interval_s: float,
        probe_timeout_s: float,
    ) -> None:
        if threads < 1 or failures_to_open < 1 or probe_interval_s <= 0:
            raise ValueError("threads and failures_to_open must be >= 1, probe interval > 0")
        self._backend = backend
        self._counters = counters
        self._lock = lock
        self._threads = threads
        self._failures_to_open = failures_to_open
        self._probe_interval_s = probe_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._routes: dict[str, _Route] = {}
        self._stop = threading.Event()
        self._probe = threading.Thread(target=self._probe_loop, name="kvtier-remote-probe")
        self._probe.daemon = True
        self._probe.start()

    def group(self, keys: Sequence[bytes]) -> tuple[dict[str, list[int]], list[int]]:
        """Indices of ``keys`` by route whose breaker is closed, and those cut off (open
        breaker, or no route could be found)."""
        try:
            names = self._backend.routes(keys)
        except RemoteError as exc:
            log.warning("%s: cannot route keys: %s", self._backend.name, exc)
            return {}, list(range(len(keys)))
        groups: dict[str, list[int]] = {}
        cut: list[int] = []
        with self._lock:
            for i, name in enumerate(names):
                route = self._routes.get(name)
                if route is not None and route.open:
                    cut.append(i)
                else:
                    groups.setdefault(name, []).append(i)
        return groups, cut

    def submit(self, name: str, fn: Callable[..., Any], *args: Any) -> Future:
        with self._lock:
            route = self._routes.get(name)
            if route is None:
                route = self._routes[name] = _Route(name, self._threads)
        return route.executor.submit(fn, *args)

    def fan_out(
        self,
        keys: Sequence[bytes],
        work: Callable[[str, list[int]], None],
        timeout: float,
        chunk: int,
    ) -> int:
        """Runs ``work(route, indices)`` on the route of each key, ``chunk`` keys a call, all at
        once, waiting at most ``timeout``; each route's breaker hears how it did. Returns how
        many keys went unanswered: their call failed or did not finish, or their route is cut
        off."""
        if not keys:
            return 0
        groups, cut = self.group(keys)
        calls = {}
        for route, indices in groups.items():
            for start in range(0, len(indices), chunk):
                part = indices[start : start + chunk]
                calls[self.submit(route, work, route, part)] = (route, len(part))
        done, late = wait(calls, timeout)
        failed: dict[str, BaseException] = {}
        missed = len(cut)
        for future in late:
            future.cancel()
            route, count = calls[future]
            failed.setdefault(route, TimeoutError(f"no answer in {timeout} s"))
            missed += count
        for future in done:
            error = future.exception()
            if error is None:
                continue
            route, count = calls[future]
            if not isinstance(error, RemoteError):
                # A bug, not the store: logged in full, but it must not fail the engine's call.
                log.error("remote tier call on %s failed", route, exc_info=error)
            failed.setdefault(route, error)
            missed += count
        for route in groups:
            if route in failed:
                self.failed(route, failed[route])
            else:
                self.succeeded(route)
        return missed

    def succeeded(self, name: str) -> None:
        with self._lock:
            route = self._routes.get(name)
            if route is not None:
                route.failures = 0

    def failed(self, name: str, error: BaseException) -> None:
        """Counts a failed call; ``RouteGone`` forgets the route instead."""
        if isinstance(error, RouteGone):
            self._forget(name)
            return
        with self._lock:
            route = self._routes.get(name)
            if route is None or route.open:
                return
            route.failures += 1
            if route.failures < self._failures_to_open:
                return
            route.open = True
            self._counters.breaker_trips += 1
        log.warning(
            "%s %s: breaker open after %d failed calls (last: %s)",
            self._backend.name,
            name,
            self._failures_to_open,
            error,
        )

    def open_routes(self) -> list[str]:
        with self._lock:
            return [name for name, route in self._routes.items() if route.open]

    def close(self) -> None:
        """Stops the probe and every route's threads; calls still running are left to end on
        their socket timeouts."""
        self._stop.set()
        self._probe.join()
        with self._lock:
            routes, self._routes = list(self._routes.values()), {}
        for route in routes:
            route.executor.shutdown(wait=False, cancel_futures=True)

    def _forget(self, name: str) -> None:
        with self._lock:
            route = self._routes.pop(name, None)
        if route is not None:
            route.executor.shutdown(wait=False, cancel_futures=True)
            log.info("%s: route %s is gone", self._backend.name, name)

    def _probe_loop(self) -> None:
        while not self._stop.wait(self._probe_interval_s):
            for name in self.open_routes():
                # On the route's own threads and within a call's deadline: a route that
                # answers a ping only slowly, or whose threads are all stuck, is still down.
                ping = self.submit(name, self._backend.ping, name)
                try:
                    ping.result(timeout=self._probe_timeout_s)
                except TimeoutError:
                    ping.cancel()
                    log.debug("%s %s: still down: no answer to a ping", self._backend.name, name)
                    continue
                except RouteGone:
                    self._forget(name)
                    continue
                except RemoteError as exc:
                    log.debug("%s %s: still down: %s", self._backend.name, name, exc)
                    continue
                except Exception:
                    # A backend bug must not end the probe: every breaker would stay open.
                    log.exception("%s %s: probe failed", self._backend.name, name)
                    continue
                with self._lock:
                    route = self._routes.get(name)
                    if route is not None:
                        route.open = False
                        route.failures = 0
                log.info("%s %s: answers again, breaker closed", self._backend.name, name)
