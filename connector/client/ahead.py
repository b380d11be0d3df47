"""Slots reserved ahead of the stores that will fill them, so that a store's Reserve is no
round trip.

Where the daemon offers it (``OpenResponse.reserve_ahead``), the client keeps up to that many
slots reserved unnamed. A store takes its slots from them at once, remembers which hash each
is for, and its Commit names them; the daemon stores each block there, or frees the slot where
a tier holds the block already. Taking slots sends a Reserve for more without waiting, so they
are there again for the next store. A store that needs more than are there reserves by hash,
as every store did before.

The slots are reserved to the session like any other, so everything that keeps reserved slots
safe keeps these: the session's share, its fence when it is lost, Close giving them back. Those
never taken are this client's alone (no copy goes to them), so when the session is lost they
leave the ledger at once (``drop``) instead of waiting for the engine to hand them back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from itertools import count

import grpc

from kvtier.connector.client.later import Failed, LaterCalls
from kvtier.connector.client.session import SlotLedger
from kvtier.connector.client.slot_stream import SlotCalls
from kvtier.proto import kvtier_pb2 as pb
from kvtier.tiers.hashing import BlockHash


class ReservedAhead:
    """The slots the live session holds reserved ahead, and the names of those taken."""

    def __init__(
        self,
        calls: SlotCalls,
        lock: threading.Lock,
        ledger: SlotLedger,
        later: LaterCalls,
        call_ids: count,
        failed: Failed,
        timeout_s: float,
        send: Callable[[Callable[[], None]], None],
    ):
        """``send(fn)`` runs ``fn`` (which sends a Reserve for more) on the stores' sender
        thread, off the engine's."""
        self._calls = calls
        self._lock = lock
        self._ledger = ledger
        self._later = later
        self._call_ids = call_ids
        self._failed = failed
        self._timeout_s = timeout_s
        self._send = send
        self._spare: list[int] = []
        """Reserved unnamed, not taken (all in ``ledger.reserved``)."""
        self._session: str | None = None
        """The session ``_spare`` belongs to."""
        self._asking = False
        """A Reserve for more is on its way."""
        self._names: dict[int, tuple[BlockHash, bytes]] = {}
        """Taken slots, until their commit or abort: the hash (and meta) each is for."""

    def __len__(self) -> int:
        """Slots reserved ahead and not taken."""
        with self._lock:
            return len(self._spare)

    def take(
        self, session: str, hashes: Sequence[BlockHash], metas: Sequence[bytes] | None, ahead: int
    ) -> list[int] | None:
        """Slots for ``hashes`` from those reserved ahead (``ahead``: how many the session may
        keep); None, having taken none, where too few are there."""
        with self._lock:
            if self._session != session:
                self._spare, self._session, self._asking = [], session, False
            taken = None
            if 0 < len(hashes) <= len(self._spare):
                taken = self._spare[-len(hashes) :]
                del self._spare[-len(hashes) :]
                for i, slot in enumerate(taken):
                    self._names[slot] = (hashes[i], metas[i] if metas else b"")
            wanted = ahead - len(self._spare)
            ask = ahead > 0 and not self._asking and len(self._spare) <= ahead // 2
            self._asking |= ask
        if ask:
            self._send(partial(self._ask, session, wanted))
        return taken

    def settle(self, timeout: float | None) -> bool:
        """Waits until the Reserve for more, if one is on its way, has been answered."""
        with self._ledger.changed:
            return self._ledger.changed.wait_for(lambda: not self._asking, timeout)

    def names(self, slots: Sequence[int]) -> dict[int, tuple[BlockHash, bytes]]:
        """Forgets the names of those of ``slots`` taken from here (they are being committed
        or aborted) and returns them; call with the lock held."""
        return {slot: name for slot in slots if (name := self._names.pop(slot, None))}

    def drop(self) -> None:
        """The session was lost: its slots never taken leave the ledger (no copy of this
        client's can be in flight through them); call with the lock held."""
        self._ledger.reserved.difference_update(self._spare)
        self._spare, self._session, self._asking = [], None, False
        self._ledger.changed.notify_all()

    def _ask(self, session: str, wanted: int) -> None:
        call_id = next(self._call_ids)
        request = pb.ReserveRequest(session_id=session, unnamed=wanted, call_id=call_id)
        try:
            future = self._calls.future("Reserve", request, self._timeout_s, polled=True)
        except BaseException:
            with self._lock:
                self._asking = False
                self._ledger.changed.notify_all()
            raise

        def answered(future) -> None:
            exc = None if future.cancelled() else future.exception()
            with self._lock:
                fresh = self._session == session
                if fresh:
                    self._asking = False
                if exc is None and not future.cancelled():
                    slots = list(future.result().slots)
                    if fresh:
                        self._spare += slots
                        self._ledger.reserved.update(slots)
                self._ledger.changed.notify_all()
            if exc is not None and isinstance(exc, grpc.RpcError):
                self._failed(
                    "Reserve", exc, session, repair=self._later.canceller(session, call_id)
                )

        future.add_done_callback(answered)
