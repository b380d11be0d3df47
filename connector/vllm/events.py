"""kvtier's host and disk tiers in vLLM's own KV event stream, for cache-aware routers.

Routers (llm-d, Dynamo, Mooncake's conductor) follow vLLM's ``BlockStored``/``BlockRemoved``
events and weigh a block by its ``medium``. The scheduler side publishes what the daemon's
tiers hold, through vLLM's publisher (``take_events``), so ``--kv-events-config`` turns it on:

* Every block an engine with events on stores carries its vLLM identity (``BlockIdentity``:
  vLLM's own block hashes and parent, token ids, LoRA, extra keys, KV cache group) as the
  block's meta, which the daemon keeps in every tier and echoes in its block events. An
  engine with events off stores none (computing it costs its thread per block), so its
  blocks are announced by no engine.
* ``TierEvents`` follows the daemon's events for the engine's layouts (``WatchEvents``, first
  replaying what the tiers hold) and turns each into vLLM's event: ``medium`` ``CPU`` for the
  host tier, ``STORAGE`` for the disk tier. The daemon serves every engine of the node, so an
  engine announces the blocks any engine of the same model stored: it can load them all.
* Only blocks of this engine's model namespace and cache epoch are announced (the identity
  names them), which are exactly those its lookups can hit; the remote tier is not announced
  (it is shared across nodes, and says nothing when it drops a block).

When the stream breaks (a daemon restart) the host tier's announced blocks are withdrawn, and
the replay on reconnection announces the disk tier again. When the daemon ends the stream
because this engine fell behind and lost events (``ABORTED``, ``contract.EVENTS_LOST``), it
watches again at once. Either way, once a new replay is done, every block it announced before
and the replay did not announce again is withdrawn, so the router's view is the tiers' again.
For that it keeps, per block announced, vLLM's hashes and group (a few hundred bytes a block).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import msgspec
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.connector.tunables import TUNABLES
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto.contract import EVENTS_LOST
from kvtier.tiers.lower import MAX_META_BYTES

log = logging.getLogger(__name__)

MEDIUMS = {"host": MEDIUM_CPU, "disk": MEDIUM_STORAGE}
_MAGIC = b"kvV1"
"""Starts every meta written here: a block another kind of engine stored is not announced."""
TAG_BYTES = 8
"""Bytes of the namespace seed an identity carries to name its model and cache epoch."""


class BlockIdentity(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a router needs to know a kvtier block, in vLLM's terms."""

    tag: bytes
    group: int
    block_hashes: list[bytes]
    parent: bytes | None
    token_ids: list[int]
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(BlockIdentity)

Shown = dict[str, dict[bytes, tuple[int, list[bytes]]]]
"""Per medium, the blocks announced: kvtier hash -> (KV cache group, vLLM's block hashes)."""


def encode_identity(identity: BlockIdentity) -> bytes:
    """The meta a block is stored with (``decode_identity`` reads it)."""
    return _MAGIC + _encoder.encode(identity)


def identities(
    request, tag: bytes, group: int, block_size: int, hash_block_size: int, start: int, stop: int
) -> tuple[bytes, ...]:
    """The metas of kvtier blocks ``[start, stop)`` of ``request`` in group ``group`` (blocks
    of ``block_size`` tokens, vLLM hashing ``hash_block_size`` at a time); ``b""`` for a
    block vLLM has not hashed, or whose identity exceeds ``MAX_META_BYTES``."""
    per_block = block_size // hash_block_size
    hashes = request.block_hashes
    lora = request.lora_request
    tokens = request.all_token_ids
    metas = []
    for block in range(start, stop):
        first, end = block * per_block, (block + 1) * per_block
        if end > len(hashes):
            metas.append(b"")
            continue
        extra = [
            generate_block_hash_extra_keys(
                request, i * hash_block_size, (i + 1) * hash_block_size, 0
            )[0]
            for i in range(first, end)
        ]
        identity = BlockIdentity(
            tag=tag,
            group=group,
            block_hashes=list(hashes[first:end]),
            parent=hashes[first - 1] if first else None,
            token_ids=list(tokens[block * block_size : (block + 1) * block_size]),
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra),
        )
        meta = encode_identity(identity)
        metas.append(meta if len(meta) <= MAX_META_BYTES else b"")
    return tuple(metas)


def decode_identity(meta: bytes) -> BlockIdentity | None:
    """The identity in a block's meta, or None (another engine's meta, or damaged)."""
    if not meta.startswith(_MAGIC):
        return None
    try:
        return _decoder.decode(memoryview(meta)[len(_MAGIC) :])
    except msgspec.DecodeError:
        return None


class TierEvents:
    """Follows the daemon's block events for each layout and buffers them as vLLM's events.

    ``tags()`` gives the namespace tags this engine can load now (its model, each group, the
    current cache epoch), mapped to their KV cache group. One thread per daemon client.
    """

    def __init__(
        self,
        clients: Sequence[DaemonClient],
        tags: Callable[[], dict[bytes, int]],
        hash_block_size: int,
    ):
        self._tags = tags
        self._block_size = hash_block_size
        self._events: deque[KVCacheEvent] = deque()
        self._room = threading.Condition()
        self._closed = threading.Event()
        self._calls: dict[int, Any] = {}
        self.undecodable = 0
        self.lost = 0
        """Streams the daemon ended because this engine fell behind and lost events."""
        self._threads = [
            threading.Thread(
                target=self._follow, args=(i, client), name=f"kvtier-events-{i}", daemon=True
            )
            for i, client in enumerate(clients)
        ]
        for thread in self._threads:
            thread.start()

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call (at most ``max_events_per_step``), oldest first."""
        with self._room:
            count = min(len(self._events), TUNABLES.max_events_per_step)
            taken = [self._events.popleft() for _ in range(count)]
            self._room.notify_all()
        return taken

    def close(self) -> None:
        self._closed.set()
        for call in list(self._calls.values()):
            call.cancel()
        with self._room:
            self._room.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)

    def _follow(self, index: int, client: DaemonClient) -> None:
        """Subscribes (with a replay) and translates until the stream ends; then subscribes
        again: at once if it ended for events lost, else (withdrawing the host blocks it
        announced) once the client has a session."""
        shown: Shown = {MEDIUM_CPU: {}, MEDIUM_STORAGE: {}}
        while not self._closed.is_set():
            client.wait_connected(1.0)
            opened = client.sessions_opened
            call = client.tools.watch_events(replay=True)
            if call is None:
                self._closed.wait(0.5)
                continue
            self._calls[index] = call
            replayed: dict[str, set[bytes]] | None = {MEDIUM_CPU: set(), MEDIUM_STORAGE: set()}
            lost = False
            try:
                for batch in call:
                    self._translate(batch, shown, replayed)
                    if batch.replay_done and replayed is not None:
                        self._withdraw_unseen(shown, replayed)
                        replayed = None
            except grpc.RpcError as exc:
                lost = _events_lost(exc)
                if lost:
                    self.lost += 1
                    log.warning("kvtier: %s; following again with a replay", exc.details())
                elif not self._closed.is_set():
                    log.info("kvtier event stream ended (%s); following again", exc.code())
            finally:
                del self._calls[index]
            if lost:
                continue
            self._withdraw(shown[MEDIUM_CPU], MEDIUM_CPU, list(shown[MEDIUM_CPU]))
            # A daemon that restarted knows this layout only once the client's new session
            # opened it: its replay would be empty before that.
            deadline = time.monotonic() + TUNABLES.resubscribe_wait_s
            while client.sessions_opened == opened and time.monotonic() < deadline:
                if self._closed.wait(0.1):
                    return

    def _translate(
        self, batch: pb.BlockEvents, shown: Shown, replayed: dict[str, set[bytes]] | None
    ) -> None:
        """Turns a batch into vLLM's events; keeps ``shown`` (and, during a replay,
        ``replayed``: what the replay announced) up to date."""
        tags = self._tags()
        events = []
        for event in batch.events:
            medium = MEDIUMS.get(event.tier)
            if medium is None or not event.meta:
                continue
            identity = decode_identity(event.meta)
            if identity is None:
                self.undecodable += 1
                continue
            if tags.get(identity.tag) != identity.group:
                continue
            stored = event.kind == pb.BlockEvent.STORED
            if stored:
                shown[medium][event.hash] = (identity.group, identity.block_hashes)
                if replayed is not None:
                    replayed[medium].add(event.hash)
            else:
                shown[medium].pop(event.hash, None)
            events.append(self._event(identity, medium, stored))
        self._put(events)

    def _withdraw_unseen(self, shown: Shown, replayed: dict[str, set[bytes]]) -> None:
        """After a replay: withdraws what was announced before and is not held any more."""
        for medium, blocks in shown.items():
            self._withdraw(blocks, medium, [h for h in blocks if h not in replayed[medium]])

    def _withdraw(
        self, blocks: dict[bytes, tuple[int, list[bytes]]], medium: str, hashes: list[bytes]
    ) -> None:
        """Announces the removal of ``hashes`` from ``blocks`` (announced in ``medium``)."""
        events = []
        for block_hash in hashes:
            group, vllm_hashes = blocks.pop(block_hash)
            events.append(
                BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(h) for h in vllm_hashes],
                    medium=medium,
                    group_idx=group,
                )
            )
        self._put(events)

    def _event(self, identity: BlockIdentity, medium: str, stored: bool) -> KVCacheEvent:
        hashes = [maybe_convert_block_hash(h) for h in identity.block_hashes]
        if not stored:
            return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=identity.group)
        parent = identity.parent
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=maybe_convert_block_hash(parent) if parent is not None else None,
            token_ids=identity.token_ids,
            block_size=self._block_size,
            lora_id=identity.lora_id,
            medium=medium,
            lora_name=identity.lora_name,
            extra_keys=identity.extra_keys,
            group_idx=identity.group,
        )

    def _put(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        with self._room:
            while len(self._events) >= TUNABLES.max_buffered_events and not self._closed.is_set():
                self._room.wait()
            self._events.extend(events)


def _events_lost(exc: grpc.RpcError) -> bool:
    """Whether the daemon ended the stream because this watcher lost events."""
    code = getattr(exc, "code", None)
    details = getattr(exc, "details", None)
    return (
        callable(code)
        and code() == grpc.StatusCode.ABORTED
        and callable(details)
        and (details() or "").startswith(EVENTS_LOST)
    )
