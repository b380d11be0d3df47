"""What this machine charges any control call, measured beside ``bench daemon``'s figures: a
round trip between two processes and a probe of a lookup index, each back to back and after
the pause a paced client takes between requests.

On a VM a process that slept for more than a few milliseconds comes back slow: for its first
few hundred microseconds everything runs several times slower (on the 2-core VM a
100-element list comprehension takes 1.5 µs back to back and about 45 µs after 20 ms asleep;
a 1,000-hash probe of the lookup index about 60 µs and 400 µs). A paced client's every
request begins that way. These floors say how much of ``lookup_p50_us`` and of a slot
operation's time is the machine's and how much is kvtier's.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from kvtier.bench.daemon.probes import hashes_for, require_compiled_probe
from kvtier.connector.client.index_reader import LookupIndexReader
from kvtier.connector.client.wire import pack_hashes
from kvtier.proto.lookup_index import HOST, LookupIndexWriter

PAUSE_S = 0.02
"""The idle pause before each timed call: longer than the few milliseconds after which a
sleeping process comes back slow, short enough for many samples."""
ROUNDS = 100
_ECHO = """import socket, sys
s = socket.socket(fileno=int(sys.argv[1]))
while m := s.recv(64):
    s.sendall(m)
"""


def idle_floors(hashes: int) -> dict[str, float]:
    """Round trip and probe medians, in µs, back to back (``_hot_``) and after ``PAUSE_S``
    asleep (``_idle_``)."""
    figures = {}
    mine, theirs = socket.socketpair()
    echo = subprocess.Popen(
        [sys.executable, "-c", _ECHO, str(theirs.fileno())], pass_fds=(theirs.fileno(),)
    )
    theirs.close()
    mine.settimeout(30)  # an echo process that hangs fails the bench instead of holding it
    try:

        def round_trip() -> None:
            mine.sendall(b"x" * 64)
            got = 0
            while got < 64:
                data = mine.recv(64 - got)
                if not data:
                    raise RuntimeError("the echo process ended")
                got += len(data)

        figures.update(hot_and_idle("round_trip", round_trip))
    finally:
        mine.close()
        echo.wait(30)
    require_compiled_probe()
    with tempfile.TemporaryDirectory(prefix="kvtier-floor-") as root:
        path = os.path.join(root, "index")
        writer = LookupIndexWriter(path, hashes)
        reader = LookupIndexReader(path)
        try:
            held = hashes_for(hashes)
            writer.set_all(held, HOST)
            figures.update(
                hot_and_idle("index_probe", lambda: reader.probe_prefix(pack_hashes(held)))
            )
        finally:
            reader.close()
            writer.close()
    return figures


def hot_and_idle(
    name: str, call: Callable[[], object], prepare: Callable[[], object] = lambda: None
) -> dict[str, float]:
    """Medians of ``call``, in µs, back to back (``{name}_hot_us``) and after ``PAUSE_S``
    asleep (``{name}_idle_us``), after a few untimed calls; ``prepare`` runs untimed before
    each call (before the pause)."""
    hot, idle = [], []
    for _ in range(10):
        prepare()
        call()
    for _ in range(ROUNDS):
        prepare()
        start = time.perf_counter()
        call()
        hot.append(time.perf_counter() - start)
    for _ in range(ROUNDS):
        prepare()
        time.sleep(PAUSE_S)
        start = time.perf_counter()
        call()
        idle.append(time.perf_counter() - start)
    return {
        f"{name}_hot_us": statistics.median(hot) * 1e6,
        f"{name}_idle_us": statistics.median(idle) * 1e6,
    }
