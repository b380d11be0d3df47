"""A cache-aware router's side of vLLM's KV event stream.

``Router`` subscribes to an engine's ZMQ publisher as llm-d or Dynamo do, asks the replay socket
for whatever it missed, decodes each batch into vLLM's event types and, separately, as the plain
msgpack arrays and maps a non-Python router reads, and keeps a set of block hashes per medium.
``router_hashes`` computes the hashes a router expects from token ids with vLLM's algorithm.
Works with vLLM 0.32, 0.33 and 0.34.
"""

from __future__ import annotations

from collections import defaultdict

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash

TOPIC = "kv"


def events_config(port: int, replay_port: int) -> dict:
    """vLLM's ``kv_events_config`` for a ZMQ publisher a ``Router`` can follow."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": TOPIC,
    }


class Router:
    """A router's view of one engine's event stream: hashes per medium, every event in order."""

    def __init__(self, port: int, replay_port: int):
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.connect(f"tcp://127.0.0.1:{port}")
        self._sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self._replay = self._context.socket(zmq.DEALER)
        self._replay.connect(f"tcp://127.0.0.1:{replay_port}")
        self._typed = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.next_seq = 0
        self.events: list = []
        self.held: dict[str, set] = defaultdict(set)

    def close(self) -> None:
        self._context.destroy(linger=0)

    def sync(self) -> None:
        """Reads what the stream sent; asks the replay socket for anything it missed."""
        while self._sub.poll(0):
            _, seq, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if seq > self.next_seq:
                self._ask_replay()
            if seq == self.next_seq:
                self._apply(seq, payload)
        self._ask_replay()

    def _ask_replay(self) -> None:
        self._replay.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            assert self._replay.poll(10_000), "the replay socket did not answer"
            _, _, seq, payload = self._replay.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                return
            if seq == self.next_seq:
                self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = self._typed.decode(payload)
        plain = msgspec.msgpack.decode(payload)  # [ts, [event maps], dp rank]
        assert len(plain[1]) == len(batch.events)
        for event, raw in zip(batch.events, plain[1], strict=True):
            assert raw["type"] == type(event).__name__
            if isinstance(event, AllBlocksCleared):
                continue
            assert raw["block_hashes"] == list(event.block_hashes)
            assert raw["medium"] == event.medium
            held = self.held[event.medium]
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            else:
                held.difference_update(event.block_hashes)
            self.events.append(event)
        self.next_seq = seq + 1


def router_hashes(
    tokens: list[int], blocks: int, block_size: int, salt: str | None = None
) -> list[int]:
    """What a router computes for the first ``blocks`` blocks of ``tokens``: vLLM's chain of
    sha256 hashes from its fixed seed, the cache salt in the first block's extra keys, in the
    events' form (the digest's low 64 bits)."""
    init_none_hash(sha256)
    parent, hashes = None, []
    for i in range(blocks):
        extra = (("cache_salt", salt),) if salt and i == 0 else None
        parent = hash_block_tokens(
            sha256, parent, tokens[i * block_size : (i + 1) * block_size], extra
        )
        hashes.append(maybe_convert_block_hash(parent))
    return hashes
