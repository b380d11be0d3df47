"""Whether a client process on this host is gone, from ``/proc``.

The daemon asks when a session ends without a ``Close``, and again at every reap while the
session's slots stay fenced: a process that is gone can copy nothing more into the arena, so
its slots may be reused. "Gone" means every thread of it has finished exiting (a zombie, or no
process at all): the kernel has released its memory and closed its files, and with them the
device contexts whose copies could still land. A process that is only exiting (``PF_EXITING``
set, or its main thread a zombie while another thread runs) may still have a copy in flight.
"""

from __future__ import annotations

import os

from kvtier.proto.contract import pid_namespace

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
