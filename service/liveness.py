"""Whether a client process on this host is gone, from ``/proc``.

The daemon asks when a session ends without a ``Close``, and again at every reap while the
session's slots stay fenced: a process that is gone can copy nothing more into the arena, so
its slots may be reused. "Gone" means every thread of it has finished exiting (a zombie, or no
process at all): the kernel has released its memory and closed its files, and with them the
device contexts whose copies could still land. A process that is only exiting (``PF_EXITING``
set, or its main thread a zombie while another thread runs) may still have a copy in flight.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable

from kvtier.proto.contract import pid_namespace

log = logging.getLogger(__name__)

_DEAD_STATES = frozenset("ZXx")
"""Zombie and dead: the task has released its memory and files."""


def can_check(pid: int, pid_ns: int) -> bool:
    """Whether ``process_gone`` can tell about this client: it named its pid, in the daemon's
    own pid namespace."""
    return pid > 0 and pid_ns == pid_namespace()


def process_gone(pid: int, pid_ns: int) -> bool:
    """True only when ``pid`` in namespace ``pid_ns`` has certainly finished exiting.

    A client in another pid namespace, or one that sent no pid, is never taken for gone.
    """
    if not can_check(pid, pid_ns):
        return False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:
            continue  # this thread was released meanwhile
        if task_state(stat) not in _DEAD_STATES:
            return False
    return True


def task_state(stat: str) -> str:
    """The state letter of a ``/proc/.../stat`` line (the field after the command name, which
    may itself hold spaces and parentheses)."""
    return stat[stat.rindex(")") + 2]


class ExitWatch:
    """Calls ``exited(key)`` once a watched process has finished exiting, from a thread of its
    own: the kernel makes a pidfd readable at that moment, so a client that dies is found gone
    at once, not at the next reap.

    A process that cannot be watched (no pidfd on this kernel) is left to ``process_gone`` at
    each reap; one already gone is reported at once.
    """

    def __init__(self, exited: Callable[[str], None]):
        self._exited = exited
        self._lock = threading.Lock()
        self._keys: dict[int, str] = {}  # pidfd -> key
        self._fds: dict[str, int] = {}
        self._poll = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        self._poll.register(self._wake_r, select.EPOLLIN)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvtier-exit-watch", daemon=True)
        self._thread.start()

    def watch(self, key: str, pid: int) -> None:
        """Reports ``key`` once ``pid`` (in this pid namespace) has finished exiting."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._exited(key)
            return
        except OSError as exc:
            log.debug("no pidfd for pid %d (%s); it is checked at each reap", pid, exc)
            return
        with self._lock:
            if self._closing:
                os.close(fd)
                return
            self._keys[fd] = key
            self._fds[key] = fd
            self._poll.register(fd, select.EPOLLIN)

    def unwatch(self, key: str) -> None:
        with self._lock:
            fd = self._fds.pop(key, None)
            if fd is not None:
                del self._keys[fd]
                self._poll.unregister(fd)
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
        os.write(self._wake_w, b"x")
        self._thread.join()
        with self._lock:
            for fd in self._keys:
                os.close(fd)
            self._keys.clear()
            self._fds.clear()
        self._poll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        while True:
            events = self._poll.poll()
            exited = []
            with self._lock:
                if self._closing:
                    return
                for fd, _ in events:
                    key = self._keys.pop(fd, None)
                    if key is None:
                        continue  # the wake-up pipe, or unwatched meanwhile
                    del self._fds[key]
                    self._poll.unregister(fd)
                    os.close(fd)
                    exited.append(key)
            for key in exited:
                self._exited(key)
