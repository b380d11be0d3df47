"""The fence: slots of a lost session are reused only once no copy of its client can land.

A session that ends without ``Close`` (its keep-alive stream broke, or its lease lapsed) may
belong to a client that still runs: an engine paused by a weight update or a slow step can
finish a queued copy into a reserved slot, or out of an acquired one, long after. Those slots
stay held (unreadable, unevictable) until one of two things proves that no copy can land:

* the client opens a new session naming the lost one. A client opens a new session only once
  it holds no slot of the old one (every copy through them has landed and been answered), so
  its word is the proof; a session id is a secret only its client knows.
* its process is gone: every thread has finished exiting (``liveness``). Checked when the
  session ends, watched from then on (the kernel says when the process has exited), and
  checked again at every reap.

No timer frees the slots of a client whose process the daemon can see. A client it cannot see
(over TCP, or in another pid namespace with no pid from the relay) gets its slots back after
``unverifiable_hold_s`` if it never comes back: a bound on the leak, not a fence.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvtier.service.liveness import ExitWatch, can_check, process_gone
from kvtier.service.sessions import Leftovers
from kvtier.service.tunables import TUNABLES

log = logging.getLogger(__name__)


class Fence:
    """Lost sessions' slots, held until their client proves it copies nothing more."""

    def __init__(self, give_back: Callable[[Leftovers], None], clock=time.monotonic):
        self._give_back = give_back
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, tuple[float, Leftovers]] = {}
        self._released: OrderedDict[str, None] = OrderedDict()
        self._exits = ExitWatch(self._exited)

    def hold(self, left: Leftovers) -> None:
        """A session ended without ``Close``: its slots come back now if its client cannot
        copy into them any more, else once it proves so."""
        if left.held:  # a lookup's holds: no copy of the client's reads them
            self._give_back(Leftovers(left.layout, [], [], held=left.held))
            left.held = []
        if not left.reserved and not left.acquired:
            return
        gone = process_gone(left.client_pid, left.client_pid_ns)
        with self._lock:
            released = left.session_id in self._released
            self._released.pop(left.session_id, None)
            fenced = not released and not gone
            if fenced:
                self._held[left.session_id] = (self._clock(), left)
        if not fenced:
            self._give_back(left)
            return
        if can_check(left.client_pid, left.client_pid_ns):
            self._exits.watch(left.session_id, left.client_pid)
        log.warning(
            "holding %d slots of session %s until its client (pid %d) reopens or exits: a "
            "copy of its may still land in them",
            len(left.reserved) + len(left.acquired),
            left.session_id[:8],
            left.client_pid,
        )

    def release(self, session_ids: Iterable[str]) -> int:
        """The client reopened naming these lost sessions: gives their slots back (or does so
        when the daemon sees them end); returns how many slots came back now."""
        back: list[Leftovers] = []
        with self._lock:
            for session_id in session_ids:
                held = self._held.pop(session_id, None)
                if held is not None:
                    back.append(held[1])
                    continue
                self._released[session_id] = None
                while len(self._released) > TUNABLES.released_ids:
                    self._released.popitem(last=False)
        for left in back:
            self._exits.unwatch(left.session_id)
            self._give_back(left)
        return sum(len(left.reserved) + len(left.acquired) for left in back)

    def sweep(self) -> int:
        """Gives back the slots of clients found gone (and of unverifiable ones held past
        ``unverifiable_hold_s``); returns how many sessions' slots came back."""
        with self._lock:
            held = list(self._held.items())
        now = self._clock()
        due = []
        for session_id, (since, left) in held:
            if can_check(left.client_pid, left.client_pid_ns):
                if process_gone(left.client_pid, left.client_pid_ns):
                    due.append(session_id)
            elif now - since >= TUNABLES.unverifiable_hold_s:
                due.append(session_id)
        with self._lock:
            back = [self._held.pop(s)[1] for s in due if s in self._held]
        for left in back:
            self._exits.unwatch(left.session_id)
            self._give_back(left)
        return len(back)

    def drain(self) -> list[Leftovers]:
        """Every held session's slots, no longer held; the fence stops watching (the daemon
        is stopping)."""
        self._exits.close()
        with self._lock:
            held, self._held = self._held, {}
        return [left for _, left in held.values()]

    def _exited(self, session_id: str) -> None:
        """The client of a fenced session has finished exiting."""
        with self._lock:
            held = self._held.pop(session_id, None)
        if held is not None:
            self._give_back(held[1])

    def held(self) -> list[Leftovers]:
        with self._lock:
            return [left for _, left in self._held.values()]
