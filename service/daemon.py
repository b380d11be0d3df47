"""The daemon's operations as plain functions of plain values: sessions, leases, the store.

The gRPC servicer translates messages into these calls and their exceptions into status codes;
the logic — who owns which slot, what a session gives back when it ends — lives here and in
``sessions``/``store``. Methods marked blocking may read or write the disk tier and are run off
the event loop by the servicer.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.proto.contract import PROTOCOL_VERSION
from kvtier.service.config import DaemonConfig
from kvtier.service.liveness import process_gone
from kvtier.service.sessions import Leftovers, Session, SessionError, SessionTable
from kvtier.service.store import BlockStore
from kvtier.service.wire import check_hash, invalid
from kvtier.tiers.host import LowerHits

log = logging.getLogger(__name__)

SIGNATURE_BYTES = 16
QUARANTINE_S = 10.0
"""How long a lost live client's slots stay held: far longer than any copy of one batch."""


@dataclass(frozen=True, slots=True)
class Opened:
    session: Session
    num_slots: int
    slot_bytes: int


class Daemon:
    """One node's shared lower tiers, handed out to sessions."""

    def __init__(self, config: DaemonConfig, store: BlockStore):
        self.config = config
        self.store = store
        self.sessions = SessionTable(config.lease_s)
        self.daemon_id = uuid.uuid4().hex
        self._quarantine: list[tuple[float, Leftovers]] = []
        self._quarantine_lock = threading.Lock()
        self._started = time.monotonic()

    # ---- sessions ----

    def open(
        self,
        client_name: str,
        signature: bytes,
        block_bytes: int,
        block_tokens: int,
        protocol_version: int,
        client_pid: int = 0,
        client_pid_ns: int = 0,
    ) -> Opened:
        if protocol_version != PROTOCOL_VERSION:
            raise invalid(
                f"protocol version {protocol_version}; this daemon speaks {PROTOCOL_VERSION}"
            )
        if len(signature) != SIGNATURE_BYTES:
            raise invalid(f"layout_signature is {len(signature)} bytes, must be 16")
        if block_bytes <= 0:
            raise invalid("block_bytes must be positive")
        self.store.open_layout(signature, block_bytes)
        session = self.sessions.open(client_name[:128], block_tokens, client_pid, client_pid_ns)
        log.info("session %s opened by %r", session.session_id[:8], session.client_name)
        return Opened(session, self.store.num_slots, self.store.block_bytes)

    def close(self, session_id: str) -> Leftovers:
        left = self.sessions.close(session_id)
        self._give_back(left)
        log.info("session %s closed", session_id[:8])
        return left

    def attach(self, session_id: str) -> None:
        self.sessions.attach(session_id)

    def detach(self, session_id: str) -> None:
        """The keep-alive stream ended: the session ends with it."""
        left = self.sessions.detach(session_id)
        if left is not None:
            self._give_back_after_loss(left)
            log.info(
                "session %s ended with its keep-alive stream (%d reserved and %d "
                "acquired slots given back)",
                session_id[:8],
                len(left.reserved),
                len(left.acquired),
            )

    def reap(self) -> int:
        """Ends lapsed sessions and frees quarantined slots that are due; returns sessions ended."""
        now = time.monotonic()
        with self._quarantine_lock:
            due = [left for until, left in self._quarantine if until <= now]
            self._quarantine = [(t, left) for t, left in self._quarantine if t > now]
        for left in due:
            self._give_back(left)
        ended = self.sessions.reap()
        for session, left in ended:
            self._give_back_after_loss(left)
            log.warning(
                "session %s of %r lapsed (%d reserved and %d acquired slots given back)",
                session.session_id[:8],
                session.client_name,
                len(left.reserved),
                len(left.acquired),
            )
        return len(ended)

    def shutdown(self) -> None:
        """Ends every session, then flushes and closes the store."""
        with self._quarantine_lock:
            held, self._quarantine = self._quarantine, []
        for _, left in held:
            self._give_back(left)
        self._give_back(self.sessions.close_all())
        self.store.close()

    # ---- blocks ----

    def lookup(self, session_id: str, hashes: Sequence[bytes]) -> LowerHits:
        session = self.sessions.get(session_id)
        return self.store.lookup(hashes, session.block_tokens)

    def reserve(self, session_id: str, hashes: Sequence[bytes]) -> list[int]:
        self.sessions.get(session_id)
        if len(set(hashes)) != len(hashes):
            raise invalid("Reserve names the same hash twice")
        slots = self.store.reserve(hashes)
        taken = [s for s in slots if s >= 0]
        if not self.sessions.add_reserved(session_id, taken):
            self.store.abort(taken)
            raise SessionError(f"session {session_id!r:.40} ended during Reserve")
        return slots

    def commit(self, session_id: str, slots: Sequence[int]) -> bool:
        """Blocking: with a disk tier the blocks are durable when this returns True."""
        self.sessions.take_reserved(session_id, slots)
        return self.store.commit(slots)

    def abort(self, session_id: str, slots: Sequence[int]) -> None:
        self.sessions.take_reserved(session_id, slots)
        self.store.abort(slots)

    def acquire(self, session_id: str, hashes: Sequence[bytes]) -> list[int]:
        """Blocking: may promote disk hits into host slots."""
        self.sessions.get(session_id)
        slots = self.store.acquire(hashes)
        if not self.sessions.add_acquired(session_id, slots):
            self.store.release(slots)
            raise SessionError(f"session {session_id!r:.40} ended during Acquire")
        return slots

    def release(self, session_id: str, slots: Sequence[int]) -> None:
        self.sessions.take_acquired(session_id, slots)
        self.store.release(slots)

    def put(self, session_id: str, block_hash: bytes, data: bytes) -> int:
        """Blocking: stores one block sent as bytes; 1 or a ``reserve`` code."""
        self.sessions.get(session_id)
        check_hash(block_hash)
        if len(data) != self.store.block_bytes:
            raise invalid(f"block data is {len(data)} bytes, must be {self.store.block_bytes}")
        return self.store.put_block(block_hash, data)

    def get(self, session_id: str, hashes: Sequence[bytes]) -> list[bytes]:
        """Blocking: copies of the held prefix of ``hashes``; slots are released at once."""
        self.sessions.get(session_id)
        slots = self.store.acquire(hashes)
        try:
            return [self.store.read_slot(slot) for slot in slots]
        finally:
            self.store.release(slots)

    # ---- statistics ----

    def stats(self) -> dict:
        """A snapshot of every counter, as plain values (for gRPC, JSON and Prometheus)."""
        reserved, acquired = self.sessions.held()
        store = self.store
        return {
            "tiers": [c.as_dict() for c in store.counters()],
            "sessions": len(self.sessions),
            "reserved_slots": reserved,
            "acquired_slots": acquired,
            "layout_signature": store.signature.hex() if store.signature else "",
            "slot_bytes": store.block_bytes,
            "uptime_s": time.monotonic() - self._started,
            "events_dropped": store.events.dropped,
        }

    def _give_back_after_loss(self, left: Leftovers) -> None:
        """Frees what a session that ended without ``Close`` held, once that is safe.

        A client that is gone copies nothing more, so its slots come back at once. A live one
        that lost its stream may still have a copy in flight into a reserved slot, or out of
        an acquired one: those slots stay held (unreadable, unevictable) for ``QUARANTINE_S``
        so that they are never reused under that copy.
        """
        if process_gone(left.client_pid, left.client_pid_ns):
            self._give_back(left)
        elif left.reserved or left.acquired:
            with self._quarantine_lock:
                self._quarantine.append((time.monotonic() + QUARANTINE_S, left))
            log.warning(
                "holding %d slots of a live client (pid %d) for %.0f s before reuse",
                len(left.reserved) + len(left.acquired),
                left.client_pid,
                QUARANTINE_S,
            )

    def _give_back(self, left: Leftovers) -> None:
        if left.reserved:
            self.store.abort(left.reserved)
        if left.acquired:
            self.store.release(left.acquired)
