"""The daemon's operations as plain functions of plain values: sessions, leases, the store.

The gRPC servicer translates messages into these calls and their exceptions into status codes;
the logic — who owns which slot, how much one session may hold, what a session gives back when
it ends — lives here and in ``sessions``/``store``. Methods marked blocking may read the disk
or the network and are run off the event loop by the servicer.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from kvtier.proto.contract import MAX_PIN_S, PROTOCOL_VERSION
from kvtier.service.config import DaemonConfig
from kvtier.service.fence import Fence
from kvtier.service.layout_store import LayoutStore
from kvtier.service.pins import LayoutPins, PinResult
from kvtier.service.rpc.wire import check_hash, invalid
from kvtier.service.sessions import ACQUIRE, AHEAD, RESERVE, Leftovers, Session, SessionTable
from kvtier.service.stats.snapshot import snapshot
from kvtier.service.store import BlockStore
from kvtier.service.tunables import TUNABLES
from kvtier.tiers.lower import MAX_META_BYTES, NO_SPACE, LowerHits

log = logging.getLogger(__name__)

SIGNATURE_BYTES = 16


@dataclass(frozen=True, slots=True)
class Opened:
    session: Session
    store: LayoutStore
    max_reserved: int
    max_acquired: int
    reserve_ahead: int


class Daemon:
    """One node's shared lower tiers, handed out to sessions."""

    def __init__(self, config: DaemonConfig, store: BlockStore):
        self.config = config
        self.store = store
        self.events = store.events
        self.sessions = SessionTable(config.lease_s, config.max_sessions)
        self.daemon_id = uuid.uuid4().hex
        self.fence = Fence(self._give_back)
        self.pins: dict[bytes, LayoutPins] = {}
        self.started = time.monotonic()

    # ---- sessions ----

    def open(
        self,
        client_name: str,
        signature: bytes,
        block_bytes: int,
        block_tokens: int,
        protocol_version: int,
        *,
        peer: str = "",
        client_pid: int = 0,
        client_pid_ns: int = 0,
        engine_group: str = "",
        lost_sessions: Sequence[str] = (),
        layout_description: str = "",
    ) -> Opened:
        """Blocking: the first Open of a layout creates its arena and opens its disk tier.

        ``lost_sessions`` are earlier sessions of this client that ended without ``Close``;
        naming them says the client holds none of their slots and has no copy in flight
        through them, so their fenced slots come back.
        """
        if protocol_version != PROTOCOL_VERSION:
            raise invalid(
                f"protocol version {protocol_version}; this daemon speaks {PROTOCOL_VERSION}"
            )
        if len(signature) != SIGNATURE_BYTES:
            raise invalid(f"layout_signature is {len(signature)} bytes, must be 16")
        if block_bytes <= 0:
            raise invalid("block_bytes must be positive")
        if lost_sessions:
            freed = self.fence.release(lost_sessions[: TUNABLES.max_lost_sessions])
            if freed:
                log.info("%d fenced slots given back: their client reopened", freed)
        store = self.store.open_layout(signature, block_bytes, block_tokens, layout_description)
        if store.host.reclaim is None:
            store.host.reclaim = partial(self._yield_hold, store)
        if signature not in self.pins:
            budget = max(1, int(store.num_slots * self.config.pin_share))
            self.pins.setdefault(signature, LayoutPins(store.host, budget))
        session = self.sessions.open(
            client_name[:128],
            signature,
            block_tokens,
            peer=peer,
            client_pid=client_pid,
            client_pid_ns=client_pid_ns,
            engine_group=engine_group,
        )
        log.info(
            "session %s opened by %r (pid %d) for layout %s",
            session.session_id[:8],
            session.client_name,
            client_pid,
            signature.hex()[:12],
        )
        quota = self.slot_quota(store)
        # A small tier keeps its slots for blocks: a thirty-second of them ahead at most.
        ahead = min(self.config.reserve_ahead_blocks, store.num_slots // 32)
        return Opened(session, store, quota, quota, ahead)

    def slot_quota(self, store: LayoutStore) -> int:
        """Most slots one session may hold reserved (and, separately, acquired)."""
        return max(1, int(store.num_slots * self.config.session_slot_share))

    def close(self, session_id: str, peer: str = "") -> Leftovers:
        left = self.sessions.close(session_id, peer)
        self._give_back(left)
        log.info("session %s closed", session_id[:8])
        return left

    def attach(self, session_id: str, peer: str = "") -> None:
        self.sessions.attach(session_id, peer)

    def detach(self, session_id: str) -> None:
        """The keep-alive stream ended: the session ends with it."""
        left = self.sessions.detach(session_id)
        if left is not None:
            self.fence.hold(left)
            log.info(
                "session %s ended with its keep-alive stream (it held %d reserved and %d "
                "acquired slots)",
                session_id[:8],
                len(left.reserved),
                len(left.acquired),
            )

    def reap(self) -> int:
        """Ends lapsed sessions and frees fenced slots of clients found gone; returns
        sessions ended."""
        now = time.monotonic()
        self.fence.sweep()
        for layout, slots in self.sessions.expire_holds(now):
            self._give_back(Leftovers(layout, [], [], held=slots))
        for pins in list(self.pins.values()):
            pins.sweep()
        ended = self.sessions.reap()
        for session, left in ended:
            self.fence.hold(left)
            log.warning(
                "session %s of %r lapsed (it held %d reserved and %d acquired slots)",
                session.session_id[:8],
                session.client_name,
                len(left.reserved),
                len(left.acquired),
            )
        return len(ended)

    def shutdown(self) -> None:
        """Ends every session, then flushes and closes the store."""
        for left in self.fence.drain():
            self._give_back(left)
        for left in self.sessions.close_all():
            self._give_back(left)
        self.store.close()

    # ---- blocks ----

    def lookup(
        self,
        session_id: str,
        hashes: Sequence[bytes],
        peer: str = "",
        memory_only: bool = False,
        probed_host: int | None = None,
    ) -> LowerHits | None:
        """Blocking when the disk or remote tier is asked; with ``memory_only`` never, and
        None (nothing done) where they would be.

        The host hits are held for the session for ``lookup_hold_s`` (within its share of
        the slots), so that the acquire that follows finds them where this answer says they
        are, however busy the host tier is meanwhile. ``probed_host``: the host hits the
        client's index probe promised (this call is its notice); no more are held (a block
        stored since was promised to nobody), and those gone since are counted. The leading
        hashes the session holds already are promised again without a walk (``holds``).
        """
        session = self.sessions.get(session_id, peer)
        store = self._store(session)
        hold = self.config.lookup_hold_s > 0
        until = time.monotonic() + self.config.lookup_hold_s
        held = self.sessions.renew_holds(session_id, hashes, until, probed_host) if hold else 0
        found = store.lookup(
            hashes[held:] if held else hashes,
            session.block_tokens,
            hold=hold,
            at_most=None if probed_host is None else probed_host - held,
            memory_only=memory_only,
            held=held,
        )
        if found is None:
            if ended := self.sessions.drop_promises(session_id, hashes[:held]):
                store.release(ended)
            return None
        hits, pinned = found
        if probed_host is not None and probed_host > hits.host:
            self.sessions.count_missed(session.layout, probed_host - hits.host)
        if pinned:
            back = self.sessions.add_holds(session_id, pinned, until, self.slot_quota(store))
            if back:
                store.release(back)
        return hits

    def below_host(self, session_id: str, peer: str = "") -> bool:
        """Whether the session's layout has a tier below the host tier: then its stores and
        the lookups its host tier misses may block on the disk or the network."""
        return self._store(self.sessions.get(session_id, peer)).below_host

    def reserve(
        self,
        session_id: str,
        hashes: Sequence[bytes],
        metas: Sequence[bytes] = (),
        call_id: int = 0,
        peer: str = "",
        unnamed: int = 0,
    ) -> list[int]:
        """Slots for the hashes, within the session's quota (beyond it: ``NO_SPACE``); or,
        with no hashes, up to ``unnamed`` slots reserved unnamed (named by their commit)."""
        if len(set(hashes)) != len(hashes):
            raise invalid("Reserve names the same hash twice")
        if unnamed and hashes:
            raise invalid("a Reserve names hashes or asks for unnamed slots, not both")
        _check_metas(metas, len(hashes))
        session = self.sessions.begin_call(session_id, call_id, peer)
        store = self._store(session)
        room = max(0, self.slot_quota(store) - len(session.reserved))
        if unnamed:
            slots = store.reserve_unnamed(min(unnamed, room))
        else:
            slots = store.reserve(hashes[:room], metas[:room])
            slots += [NO_SPACE] * (len(hashes) - len(slots))
        taken = [s for s in slots if s >= 0]
        if not self.sessions.end_call(session_id, call_id, AHEAD if unnamed else RESERVE, taken):
            store.abort(taken)
            return [NO_SPACE] * len(hashes)
        return slots

    def commit(
        self,
        session_id: str,
        slots: Sequence[int],
        peer: str = "",
        hashes: Sequence[bytes] = (),
        metas: Sequence[bytes] = (),
    ) -> int:
        """Makes reserved slots readable; slots reserved unnamed are named by ``hashes``
        (and ``metas``). Returns how many named ones were not stored (held already)."""
        if hashes and len(hashes) != len(slots):
            raise invalid(f"a Commit names {len(hashes)} hashes for {len(slots)} slots")
        _check_metas(metas, len(hashes))
        session = self.sessions.take_reserved(session_id, slots, peer)
        store = self._store(session)
        not_stored = 0
        try:
            if hashes:
                not_stored = store.commit_named(slots, hashes, metas)
            else:
                store.commit(slots)
        except ValueError as exc:
            # Unnamed slots committed without hashes, or the other way round: the tier
            # changed nothing, and the client loses these blocks, not the slots.
            store.abort(slots)
            raise invalid(str(exc)) from exc
        self.pins[session.layout].committed()
        return not_stored

    def abort(self, session_id: str, slots: Sequence[int], peer: str = "") -> None:
        session = self.sessions.take_reserved(session_id, slots, peer)
        self._store(session).abort(slots)

    def acquire(
        self,
        session_id: str,
        hashes: Sequence[bytes],
        call_id: int = 0,
        peer: str = "",
        memory_only: bool = False,
    ) -> tuple[list[int], LowerHits] | None:
        """Blocking: may promote disk hits into host slots; with ``memory_only`` never, and
        None (nothing taken) where it would. Within the session's quota."""
        session = self.sessions.begin_call(session_id, call_id, peer)
        store = self._store(session)
        room = max(0, self.slot_quota(store) - session.acquired.total())
        if (found := store.acquire(hashes[:room], memory_only)) is None:
            return None  # the call stays registered as running: its blocking retry ends it
        slots, sources = found
        held = self.sessions.take_holds(session_id, hashes)
        if held:  # the acquire pinned them itself
            store.release(held)
        if not self.sessions.end_call(session_id, call_id, ACQUIRE, slots):
            store.release(slots)
            return [], LowerHits()
        return slots, sources

    def release(self, session_id: str, slots: Sequence[int], peer: str = "") -> None:
        session = self.sessions.take_acquired(session_id, slots, peer)
        self._store(session).release(slots)

    def cancel(self, session_id: str, call_id: int, peer: str = "") -> int:
        """Gives back what the call took (now, or when it finishes); returns slots given now."""
        session = self.sessions.get(session_id, peer)
        kind, slots = self.sessions.cancel(session_id, call_id, peer)
        if slots:
            self._give_back(
                Leftovers(
                    session.layout,
                    slots if kind == RESERVE else [],
                    slots if kind == ACQUIRE else [],
                )
            )
        return len(slots)

    def pin(
        self, session_id: str, hashes: Sequence[bytes], seconds: float, peer: str = ""
    ) -> PinResult:
        """Keeps the committed blocks among ``hashes`` in the host tier for ``seconds``,
        within the session's pin budget (``pins``)."""
        if not 0 < seconds <= MAX_PIN_S:
            raise invalid(f"a pin lasts more than 0 and at most {MAX_PIN_S:g} seconds")
        for h in hashes:
            check_hash(h)
        session = self.sessions.get(session_id, peer)
        return self.pins[session.layout].pin(session_id, hashes, seconds)

    def put(
        self, session_id: str, block_hash: bytes, meta: bytes, data: bytes, peer: str = ""
    ) -> int:
        """Blocking: stores one block sent as bytes; 1 or a ``reserve`` code."""
        session = self.sessions.get(session_id, peer)
        store = self._store(session)
        check_hash(block_hash)
        if len(meta) > MAX_META_BYTES:
            raise invalid(f"a block's meta may be at most {MAX_META_BYTES} bytes")
        if len(data) != store.block_bytes:
            raise invalid(f"block data is {len(data)} bytes, must be {store.block_bytes}")
        return store.put_block(block_hash, meta, data)

    def get(self, session_id: str, hashes: Sequence[bytes], peer: str = "") -> list[bytes]:
        """Blocking: copies of the held prefix of ``hashes``; slots are released at once."""
        session = self.sessions.get(session_id, peer)
        store = self._store(session)
        slots, _ = store.acquire(hashes)
        try:
            return [store.read_slot(slot) for slot in slots]
        finally:
            store.release(slots)

    # ---- statistics ----

    def stats(self) -> dict:
        """A snapshot of every counter, as plain values (for gRPC, JSON and Prometheus)."""
        return snapshot(self)

    # ---- internals ----

    def _yield_hold(self, store: LayoutStore) -> bool:
        """Ends the layout's oldest lookup hold (a promotion found every slot pinned)."""
        slots = self.sessions.yield_oldest_hold(store.signature)
        if slots:
            store.release(slots)
        return bool(slots)

    def _store(self, session: Session) -> LayoutStore:
        store = self.store.get(session.layout)
        assert store is not None, "a session's layout outlives it"
        return store

    def _give_back(self, left: Leftovers) -> None:
        store = self.store.get(left.layout)
        if store is None:
            return
        if left.reserved:
            store.abort(left.reserved)
        if left.acquired or left.held:
            store.release(left.acquired + left.held)


def _check_metas(metas: Sequence[bytes], blocks: int) -> None:
    if metas and len(metas) != blocks:
        raise invalid(f"{len(metas)} metas for {blocks} hashes")
    if any(len(m) > MAX_META_BYTES for m in metas):
        raise invalid(f"a block's meta may be at most {MAX_META_BYTES} bytes")
