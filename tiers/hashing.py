"""Chained 16-byte block hashes.

``hash(block i) = xxh3_128(hash(block i-1) ‖ token ids as little-endian int32 ‖ extra)``, with
the root parent a seed derived from the namespace (model name and fingerprint, layout
signature, tensor-parallel shard and world size, pipeline stage's layers, KV cache group, hash
version). Every input is fixed bytes, so hashes agree across processes, hosts and restarts,
which is what lets the disk tier be reused after a restart.
``extra`` carries the LoRA adapter's key (its content, where the engine can read it) and the
multimodal hashes of the inputs a block overlaps on every block, and the request's
``cache_salt`` on the root block only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np
import xxhash

HASH_BYTES = 16
HASH_VERSION = 1

BlockHash = bytes


def check_hash(block_hash: bytes) -> None:
    """Raises ``ValueError`` unless ``block_hash`` is a 16-byte ``bytes``."""
    if not isinstance(block_hash, bytes) or len(block_hash) != HASH_BYTES:
        raise ValueError(f"a block hash is {HASH_BYTES} bytes, got {block_hash!r:.40}")


def check_hashes(hashes: Sequence[bytes]) -> None:
    """``check_hash`` of every hash, the checks run in C (a lookup names up to 65,536)."""
    if not all(map(isinstance, hashes, repeat(bytes))) or any(
        length != HASH_BYTES for length in set(map(len, hashes))
    ):
        for block_hash in hashes:
            check_hash(block_hash)  # raises, naming the first bad one


@dataclass(frozen=True, slots=True)
class Namespace:
    """What makes two engines' blocks interchangeable: same model (name and fingerprint),
    layout, TP shard and world, pipeline stage's layers, and KV cache group.

    ``fingerprint`` holds what the model's KV depends on beyond its name (its config, revision,
    weights, KV scales; the connector computes it). ``tp_rank`` names the shard of the KV a
    rank holds: ranks holding identical KV (an MLA latent, replicated KV heads) share one, so
    the block is stored once for all of them. ``layers`` is ``(first, count)``, the decoder
    layers whose KV the block holds when pipeline parallelism splits them over stages; None:
    all of them. ``group`` tells apart the KV cache groups of a hybrid model, whose blocks may
    have one layout but hold other layers. ``fingerprint``, ``layers`` and ``group`` enter the
    seed only when set, so a namespace without them keeps the names it always had.
    """

    model_id: str
    layout_signature: bytes
    tp_rank: int = 0
    tp_world_size: int = 1
    hash_version: int = HASH_VERSION
    group: int = 0
    layers: tuple[int, int] | None = None
    fingerprint: bytes = b""

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_world_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside world size {self.tp_world_size}")
        if self.group < 0:
            raise ValueError(f"group must be >= 0, got {self.group}")
        if self.layers is not None and (
            len(self.layers) != 2 or self.layers[0] < 0 or self.layers[1] <= 0
        ):
            raise ValueError(f"layers must be (first >= 0, count > 0), got {self.layers}")

    @property
    def seed(self) -> BlockHash:
        """The root parent hash: xxh3_128 over a length-prefixed encoding of every field."""
        model = self.model_id.encode()
        blob = b"".join(
            [
                b"kvtier-ns",
                len(model).to_bytes(4, "little"),
                model,
                self.layout_signature,
                self.tp_rank.to_bytes(4, "little"),
                self.tp_world_size.to_bytes(4, "little"),
                self.hash_version.to_bytes(4, "little"),
                b"group" + self.group.to_bytes(4, "little") if self.group else b"",
                self._layers_bytes(),
                self._fingerprint_bytes(),
            ]
        )
        return xxhash.xxh3_128_digest(blob)

    def _layers_bytes(self) -> bytes:
        if self.layers is None:
            return b""
        first, count = self.layers
        return b"layers" + first.to_bytes(4, "little") + count.to_bytes(4, "little")

    def _fingerprint_bytes(self) -> bytes:
        if not self.fingerprint:
            return b""
        return b"fp" + len(self.fingerprint).to_bytes(4, "little") + self.fingerprint


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    """A multimodal input whose placeholder tokens occupy ``[offset, offset + length)``."""

    offset: int
    length: int
    content_hash: str


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """Request properties that change a block's meaning without changing its token ids."""

    lora: str | None = None
    """The LoRA adapter's key: a digest of its files, or its name where they are unknown."""
    mm_inputs: tuple[MultiModalInput, ...] = field(default_factory=tuple)
    cache_salt: str | None = None

    def for_block(self, start: int, end: int, root: bool) -> bytes:
        """The extra bytes of the block covering tokens ``[start, end)``; empty if none apply."""
        parts: list[bytes] = []
        if self.lora:
            parts.append(b"L" + self.lora.encode())
        for mm in self.mm_inputs:
            if mm.offset < end and start < mm.offset + mm.length:
                parts.append(b"M" + mm.content_hash.encode())
        if root and self.cache_salt:
            parts.append(b"S" + self.cache_salt.encode())
        return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


NO_EXTRA = ExtraKeys()


def hash_block_chain(
    parent: BlockHash,
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    extra: ExtraKeys = NO_EXTRA,
    first_block_index: int = 0,
) -> list[BlockHash]:
    """Hashes every full block of ``token_ids``, chained from ``parent``.

    ``first_block_index`` is the index of the first of these blocks within the request, so
    the salt goes to block 0 only and multimodal ranges line up when extending a sequence.
    """
    tokens = np.asarray(token_ids, dtype="<i4")
    raw = tokens.tobytes()
    step = block_size * 4
    plain = extra is NO_EXTRA or extra == NO_EXTRA
    hashes: list[BlockHash] = []
    digest = xxhash.xxh3_128_digest
    for i in range(len(tokens) // block_size):
        chunk = raw[i * step : (i + 1) * step]
        if plain:
            parent = digest(parent + chunk)
        else:
            index = first_block_index + i
            start = index * block_size
            parent = digest(parent + chunk + extra.for_block(start, start + block_size, index == 0))
        hashes.append(parent)
    return hashes


class BlockHasher:
    """Hashes one request's prompt and keeps up with it as tokens are appended."""

    __slots__ = ("_block_size", "_extra", "_hashes", "_pending", "_seed")

    def __init__(self, namespace: Namespace, block_size: int, extra: ExtraKeys = NO_EXTRA):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._seed = namespace.seed
        self._block_size = block_size
        self._extra = extra
        self._hashes: list[BlockHash] = []
        self._pending: list[int] = []

    @property
    def hashes(self) -> list[BlockHash]:
        """Hashes of every full block seen so far (do not mutate)."""
        return self._hashes

    def extend(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Appends tokens; returns the hashes of the blocks they completed."""
        self._pending.extend(int(t) for t in token_ids)
        full = len(self._pending) // self._block_size * self._block_size
        if full == 0:
            return []
        parent = self._hashes[-1] if self._hashes else self._seed
        new = hash_block_chain(
            parent, self._pending[:full], self._block_size, self._extra, len(self._hashes)
        )
        del self._pending[:full]
        self._hashes.extend(new)
        return new


def hash_prompt(
    namespace: Namespace,
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    extra: ExtraKeys = NO_EXTRA,
) -> list[BlockHash]:
    """Hashes every full block of a whole prompt in one call."""
    return hash_block_chain(namespace.seed, token_ids, block_size, extra)
