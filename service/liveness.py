"""Whether a client process on this host is gone, from ``/proc``.

The daemon asks when a session ends without a ``Close``: a process that is gone can copy
nothing more into the arena, so its slots may be reused at once.
"""

from __future__ import annotations

from kvtier.proto.contract import pid_namespace

_PF_EXITING = 0x4  # set at the start of the kernel's exit path, before files are closed


def process_gone(pid: int, pid_ns: int) -> bool:
    """True only when ``pid`` in namespace ``pid_ns`` has certainly exited or is exiting.

    A client in another pid namespace, or one that sent no pid, is never taken for gone.
    """
    if pid <= 0 or pid_ns != pid_namespace():
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    # Fields after the parenthesised command name: state, ppid, pgrp, session, tty, tpgid, flags.
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0] in ("Z", "X", "x") or bool(int(fields[6]) & _PF_EXITING)
