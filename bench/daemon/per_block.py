"""What the daemon's own work costs, without the wire: ``kvtier bench daemon``'s
``daemon_{reserve,commit,acquire,release}_us_per_block`` and ``daemon_notice_{hot,idle}_us``.

A private ``Daemon`` (host tier only, full, so every Reserve evicts as many blocks as it takes,
as a busy node's does) is called in this process, as the servicer calls it for a Reserve,
Commit, Acquire and Release of ``batch`` new blocks, round after round. What a call over the
slot channel adds (decoding, the event loop, the answer) is the same for any number of blocks;
what grows with a store's or a load's length is this. Blocks are 64 KiB whatever the bench's
block size: no bytes move here, and the arena stays small.

Then the same daemon takes a probed lookup's notice of ``hashes`` stored blocks, again and
again, as the servicer runs one on its lookup thread: back to back, and each after a paced
client's idle pause, as the machine's floors are timed (``floors.hot_and_idle``). Each
notice but the first finds its hits held already by its session's last one, as an engine's
repeated lookups of a prefix do (``daemon_notice_*``: the holds renewed, the counters
counted); ``daemon_notice_fresh_*`` ends the holds before each (untimed), so that each
notice walks the host tier and pins and holds every hit.
With eight paced clients on the 2-core VM, a daemon that did none of this work kept the slot
operations' p99 within 2 ms where the whole of it took them to 2.4-3.6 ms
(docs/performance.md), so this is the figure that tail follows.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from kvtier.bench.daemon.floors import hot_and_idle
from kvtier.proto.contract import PROTOCOL_VERSION
from kvtier.service.config import DaemonConfig
from kvtier.service.daemon import Daemon
from kvtier.service.events import EventHub
from kvtier.service.store import BlockStore

BLOCK_BYTES = 64 << 10
SLOTS = 2048
LAYOUT = b"p" * 16
WARM_ROUNDS = 5
CALLS = ("reserve", "commit", "acquire", "release")
NOTICE_STORE_BATCH = 256
"""Blocks stored per Reserve and Commit before the notices, as a connector stores a prompt."""


def per_block_us(batch: int, rounds: int, hashes: int) -> dict[str, float]:
    """Median microseconds per block of each call, over ``rounds`` rounds of ``batch`` blocks,
    and of a notice of ``hashes`` (at most half the tier's slots)."""
    return asyncio.run(_measure(batch, rounds, min(hashes, SLOTS // 2)))


async def _measure(batch: int, rounds: int, notice_hashes: int) -> dict[str, float]:
    # a short root: the daemon's socket path must fit 107 bytes
    with tempfile.TemporaryDirectory(prefix="kvb-", dir="/tmp") as root:
        config = DaemonConfig(
            name=f"bench-{uuid.uuid4().hex[:8]}",
            socket=Path(root) / "d.sock",
            data_dir=Path(root) / "data",
            host_bytes=SLOTS * BLOCK_BYTES,
            disk_bytes=0,
        )
        events = EventHub(asyncio.get_running_loop(), max_subscribers=1)
        daemon = Daemon(config, BlockStore(config, events))
        try:
            opened = daemon.open("bench-per-block", LAYOUT, BLOCK_BYTES, 16, PROTOCOL_VERSION)
            session = opened.session.session_id
            times: dict[str, list[float]] = {name: [] for name in CALLS}
            # enough rounds to fill the tier first: then each Reserve evicts what it takes
            for round_ in range(SLOTS // batch + WARM_ROUNDS + rounds):
                hashes = [uuid.uuid4().bytes for _ in range(batch)]
                t0 = time.perf_counter()
                slots = daemon.reserve(session, hashes)
                t1 = time.perf_counter()
                daemon.commit(session, slots)
                t2 = time.perf_counter()
                got, _ = daemon.acquire(session, hashes, memory_only=True)
                t3 = time.perf_counter()
                daemon.release(session, got)
                t4 = time.perf_counter()
                if min(slots) < 0 or len(got) != batch:
                    raise RuntimeError(f"a round missed: {slots[:4]}, {len(got)} acquired")
                if round_ >= SLOTS // batch + WARM_ROUNDS:
                    spans = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
                    for name, seconds in zip(CALLS, spans, strict=True):
                        times[name].append(seconds)
            notices = _notice_us(daemon, session, notice_hashes)
        finally:
            daemon.shutdown()
    return {
        **{
            f"daemon_{name}_us_per_block": statistics.median(seconds) * 1e6 / batch
            for name, seconds in times.items()
        },
        **notices,
    }


def _notice_us(daemon: Daemon, session: str, count: int) -> dict[str, float]:
    """The daemon's work on a notice of ``count`` held blocks (``hot_and_idle``)."""
    hashes = [uuid.uuid4().bytes for _ in range(count)]
    for start in range(0, count, NOTICE_STORE_BATCH):
        stored = hashes[start : start + NOTICE_STORE_BATCH]
        daemon.commit(session, daemon.reserve(session, stored))

    def notice() -> None:
        hits = daemon.lookup(session, hashes, probed_host=count)
        if hits is None or hits.host != count:
            raise RuntimeError(f"a notice found {hits} of {count} host hits")

    def end_holds() -> None:
        # each take ends one promise of each hold; a hold ends with its last promise
        while daemon.sessions.held(LAYOUT)[4]:
            daemon.store.get(LAYOUT).release(daemon.sessions.take_holds(session, hashes))

    return {
        **hot_and_idle("daemon_notice", notice),
        **hot_and_idle("daemon_notice_fresh", notice, prepare=end_holds),
    }
