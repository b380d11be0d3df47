"""The daemon's view of its tiers, as the scheduler side sees it: capacity gauges for vLLM's
``/metrics`` and the read rates the load gate weighs.

One Stats call at a time runs on a thread of its own, at most every ``capacity_refresh_s``;
the engine thread only looks at whether the last one has answered, so a slow or absent daemon
never holds up a step.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.connector.tunables import TUNABLES
from kvtier.connector.vllm.stats import TIERS
from kvtier.proto import kvtier_pb2 as pb

log = logging.getLogger(__name__)

_SUMMED = ("used_bytes", "capacity_bytes", "used_blocks", "capacity_blocks")


class TierWatch:
    """The latest Stats of the daemon for this engine's ``layouts`` (signatures)."""

    def __init__(
        self,
        client: DaemonClient,
        layouts: Iterable[bytes],
        refresh_s: float = TUNABLES.capacity_refresh_s,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._client = client
        self._layouts = {signature.hex() for signature in layouts}
        self._main = client.layout_signature.hex()
        self._refresh_s = refresh_s
        self._clock = clock
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-stats")
        self._call: Future[pb.StatsResponse | None] | None = None
        self._asked = -math.inf
        self._gauges: dict[str, float] | None = None
        self.read_bytes_per_s: dict[str, float] = {}
        """What each tier's reads delivered lately, for the first layout; a tier that has
        not read yet is absent."""

    def poll(self) -> dict[str, float] | None:
        """Never blocks: takes the answer of the last call if it is in, starts the next one
        when it is due; returns gauges keyed ``<name>.<tier>`` once per answer, else None."""
        if self._call is not None and self._call.done():
            self._take(self._call)
        if self._call is None and self._clock() - self._asked >= self._refresh_s:
            self._asked = self._clock()
            self._call = self._pool.submit(self._client.tools.stats)
        gauges, self._gauges = self._gauges, None
        return gauges

    def refresh(self, timeout: float | None = None) -> bool:
        """Asks the daemon now and waits for its answer; for tests, which want the state they
        check not to depend on when the last call ran. vLLM never waits."""
        if self._call is not None:
            self._call.exception(timeout)  # waits for it
            self._take(self._call)
        self._asked = self._clock()
        call = self._call = self._pool.submit(self._client.tools.stats)
        call.exception(timeout)
        return self._take(call)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _take(self, call: Future[pb.StatsResponse | None]) -> bool:
        """Reads a finished call's answer; False (the last values stand) if there is none."""
        self._call = None
        error = call.exception()
        if error is not None:  # not an RPC error (those the client counts): a closed channel
            log.warning("kvtier: reading the daemon's stats failed: %r", error)
            return False
        reply = call.result()
        if reply is None:
            return False  # the daemon did not answer (counted by the client)
        gauges: dict[str, float] = {}
        for tier in reply.tiers:
            if tier.layout not in self._layouts or tier.tier not in TIERS:
                continue
            for name in _SUMMED:
                key = f"{name}.{tier.tier}"
                gauges[key] = gauges.get(key, 0) + getattr(tier, name)
            if tier.HasField("oldest_block_age_s"):
                key = f"oldest_block_age_seconds.{tier.tier}"
                gauges[key] = max(gauges.get(key, 0.0), tier.oldest_block_age_s)
            if tier.layout == self._main and tier.read_bytes_per_s > 0:
                self.read_bytes_per_s[tier.tier] = tier.read_bytes_per_s
        self._gauges = gauges
        return True
