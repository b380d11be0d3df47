"""The daemon's blocks: the host tier on the shared arena over the disk tier, for one layout.

A daemon serves ONE layout (signature and block size) for its whole data directory. The first
client's ``Open`` fixes it and, with a disk tier, it is written to ``namespace.json`` so a
restarted daemon reopens the same disk tier at once; an ``Open`` for any other layout is
refused (``LayoutMismatch``). Running one daemon per model (``--name``) keeps slots a single
size, so the arena never fragments.

Commits write through: with a disk tier, ``commit`` puts the blocks into it and waits for the
writer's flush before it makes them readable, so every block whose commit returned survives a
daemon killed with SIGKILL. The host tier then is a read cache in front of the disk tier and
its evictions never need to spill.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence

import numpy as np

from kvtier.service.arena import Arena
from kvtier.service.config import DaemonConfig
from kvtier.service.events import STORED, EventHub
from kvtier.tiers.counters import TierCounters
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier, LowerHits

log = logging.getLogger(__name__)

NAMESPACE_FILE = "namespace.json"


class LayoutMismatch(ValueError):
    """A client's layout differs from the one this daemon serves."""


class StoreUnavailable(RuntimeError):
    """The disk tier could not make a commit durable."""


class BlockStore:
    """Host tier (shared arena) → disk tier, built when the layout is known."""

    def __init__(self, config: DaemonConfig, arena: Arena, events: EventHub):
        self.config = config
        self.arena = arena
        self.events = events
        self.signature: bytes | None = None
        self.block_bytes = 0
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        self.host_counters = TierCounters("host")
        self.disk_counters = TierCounters("disk")
        self._lock = threading.Lock()
        self._writing: dict[int, bytes] = {}  # reserved slot -> its hash, until commit/abort
        # Hashes committed to the host tier, kept from its stored/removed events: answers the
        # common all-in-host lookup with one C-level set test instead of a Python walk.
        self._in_host: set[bytes] = set()
        saved = self._saved_namespace()
        if saved is not None:
            self._build(*saved)

    # ---- layout ----

    def open_layout(self, signature: bytes, block_bytes: int) -> None:
        """Fixes the layout at the first call; later calls must name the same one."""
        with self._lock:
            if self.signature is None:
                if block_bytes > self.arena.size:
                    raise LayoutMismatch(
                        f"a block of {block_bytes} B does not fit the {self.arena.size} B host "
                        "tier; raise --host-bytes"
                    )
                self._build(signature, block_bytes)
                self._save_namespace()
                return
        if signature != self.signature or block_bytes != self.block_bytes:
            raise LayoutMismatch(
                f"this daemon serves layout {self.signature.hex()} with {self.block_bytes} B "
                f"blocks, not {signature.hex()} with {block_bytes} B; run one daemon per layout "
                f"(--name) or clear {self.config.disk_path}"
            )

    @property
    def num_slots(self) -> int:
        return self.host.num_slots if self.host is not None else 0

    def counters(self) -> list[TierCounters]:
        return [self.host_counters, self.disk_counters] if self.disk else [self.host_counters]

    # ---- operations (the servicer has validated their arguments) ----

    def lookup(self, hashes: Sequence[bytes], block_tokens: int) -> LowerHits:
        if self._in_host.issuperset(hashes):
            hits = LowerHits(host=len(hashes))
        else:
            hits = self.host.lookup(hashes)
        host_c, disk_c = self.host_counters, self.disk_counters
        host_c.query_tokens += len(hashes) * block_tokens
        host_c.hit_tokens += hits.host * block_tokens
        if self.disk is not None:
            disk_c.query_tokens += (len(hashes) - hits.host) * block_tokens
            disk_c.hit_tokens += hits.disk * block_tokens
        return hits

    def reserve(self, hashes: Sequence[bytes]) -> list[int]:
        slots = self.host.reserve(hashes)
        with self._lock:
            for h, slot in zip(hashes, slots, strict=True):
                if slot >= 0:
                    self._writing[slot] = h
        return slots

    def commit(self, slots: Sequence[int]) -> bool:
        """Makes the slots readable, durable first when there is a disk tier (blocking)."""
        with self._lock:
            hashes = [self._writing.pop(slot) for slot in slots]
        if self.disk is not None and slots:
            try:
                for h, slot in zip(hashes, slots, strict=True):
                    self.disk.put(h, self.host.slot_array(slot))
                self.disk.flush()
            except (RuntimeError, TimeoutError) as exc:
                log.error("commit of %d blocks not durable: %r", len(slots), exc)
                self.host.abort(slots)
                raise StoreUnavailable(f"disk tier could not store the blocks: {exc}") from exc
        self.host.commit(slots)
        return self.disk is not None

    def abort(self, slots: Sequence[int]) -> None:
        with self._lock:
            for slot in slots:
                self._writing.pop(slot, None)
        self.host.abort(slots)

    def acquire(self, hashes: Sequence[bytes]) -> list[int]:
        """Pins the held prefix of ``hashes`` (may read the disk: blocking)."""
        return self.host.acquire(hashes)

    def release(self, slots: Sequence[int]) -> None:
        self.host.release(slots)

    def put_block(self, block_hash: bytes, data: bytes) -> int:
        """Stores one block sent as bytes; returns 1, or the ``reserve`` code it got."""
        (slot,) = self.reserve([block_hash])
        if slot < 0:
            return slot
        try:
            self.host.slot_array(slot)[:] = np.frombuffer(data, dtype=np.uint8)
        except BaseException:
            self.abort([slot])
            raise
        self.commit([slot])
        return 1

    def read_slot(self, slot: int) -> bytes:
        return self.host.slot_array(slot).tobytes()

    def close(self) -> None:
        """Flushes and closes the disk tier (the arena belongs to the caller)."""
        if self.disk is not None:
            self.disk.close()

    # ---- internals ----

    def _build(self, signature: bytes, block_bytes: int) -> None:
        disk = None
        if self.config.disk_bytes > 0:
            path = self.config.disk_path / "lmdb"
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            disk = DiskTier(
                path,
                signature,
                block_bytes,
                self.config.disk_bytes,
                self.disk_counters,
                self._disk_event,
                sync=self.config.disk_sync,
            )
            log.info(
                "disk tier %s: %d of %d blocks used",
                path,
                self.disk_counters.used_blocks,
                self.disk_counters.capacity_blocks,
            )
        self.host = HostTier(
            block_bytes,
            self.arena.size,
            buffer=self.arena.tensor,
            lower=disk,
            counters=self.host_counters,
            on_event=self._host_event,
        )
        self.disk = disk
        self.signature = signature
        self.block_bytes = block_bytes
        log.info(
            "layout %s: %d host slots of %d B", signature.hex(), self.host.num_slots, block_bytes
        )

    def _host_event(self, kind: str, block_hash: bytes) -> None:
        # Runs under the host tier's lock, so the set changes in step with its index.
        if kind == STORED:
            self._in_host.add(block_hash)
        else:
            self._in_host.discard(block_hash)
        self.events.emit(kind, "host", block_hash)

    def _disk_event(self, kind: str, block_hash: bytes, meta: bytes = b"") -> None:
        self.events.emit(kind, "disk", block_hash)

    def _saved_namespace(self) -> tuple[bytes, int] | None:
        if self.config.disk_bytes <= 0:
            return None
        path = self.config.disk_path / NAMESPACE_FILE
        if not path.exists():
            return None
        saved = json.loads(path.read_text())
        return bytes.fromhex(saved["layout_signature"]), int(saved["block_bytes"])

    def _save_namespace(self) -> None:
        if self.disk is None:
            return
        path = self.config.disk_path / NAMESPACE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps({"layout_signature": self.signature.hex(), "block_bytes": self.block_bytes})
        )
        os.replace(tmp, path)
