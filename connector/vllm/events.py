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
the replay on reconnection announces the disk tier again.
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
from kvtier.proto import kvtier_pb2 as pb
from kvtier.tiers.lower import MAX_META_BYTES

log = logging.getLogger(__name__)

MEDIUMS = {"host": MEDIUM_CPU, "disk": MEDIUM_STORAGE}
_MAGIC = b"kvV1"
"""Starts every meta written here: a block another kind of engine stored is not announced."""
TAG_BYTES = 8
"""Bytes of the namespace seed an identity carries to name its model and cache epoch."""
MAX_BUFFERED = 1 << 16
"""Most translated events waiting for vLLM's next step; the stream waits beyond that."""
MAX_PER_STEP = 1 << 14
"""Most events handed to one step's batch (a replay of a large disk tier spans steps)."""
_RESUBSCRIBE_WAIT_S = 5.0


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
        meta = _MAGIC + _encoder.encode(identity)
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
        self._threads = [
            threading.Thread(
                target=self._follow, args=(i, client), name=f"kvtier-events-{i}", daemon=True
            )
            for i, client in enumerate(clients)
        ]
        for thread in self._threads:
            thread.start()

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call (at most ``MAX_PER_STEP``), oldest first."""
        with self._room:
            count = min(len(self._events), MAX_PER_STEP)
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
        """Subscribes (with a replay), translates until the stream ends, withdraws the host
        blocks it announced, and subscribes again once the client has a session."""
        while not self._closed.is_set():
            client.wait_connected(1.0)
            opened = client.sessions_opened
            call = client.watch_events(replay=True)
            if call is None:
                self._closed.wait(0.5)
                continue
            self._calls[index] = call
            announced: dict[bytes, BlockIdentity] = {}
            try:
                for batch in call:
                    self._translate(batch, announced)
            except grpc.RpcError as exc:
                if not self._closed.is_set():
                    log.info("kvtier event stream ended (%s); following again", exc.code())
            finally:
                del self._calls[index]
            self._put([self._event(identity, MEDIUM_CPU, False) for identity in announced.values()])
            # A daemon that restarted knows this layout only once the client's new session
            # opened it: its replay would be empty before that.
            deadline = time.monotonic() + _RESUBSCRIBE_WAIT_S
            while client.sessions_opened == opened and time.monotonic() < deadline:
                if self._closed.wait(0.1):
                    return

    def _translate(self, batch: pb.BlockEvents, announced: dict[bytes, BlockIdentity]) -> None:
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
            if medium == MEDIUM_CPU:
                if stored:
                    announced[event.hash] = identity
                else:
                    announced.pop(event.hash, None)
            events.append(self._event(identity, medium, stored))
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
            while len(self._events) >= MAX_BUFFERED and not self._closed.is_set():
                self._room.wait()
            self._events.extend(events)
