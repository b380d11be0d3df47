"""What the scheduler-side connector tells the workers each step.

A load or a store names one KV cache group's vLLM block ids and, per tensor-parallel shard of
that group's KV, the kvtier hashes of those blocks packed 16 bytes each (ranks holding one
shard share its namespace; see ``groups``). One spec per request and group. Plain
dataclasses of lists and bytes, so the metadata pickles cheaply to worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvtier.tiers.hashing import HASH_BYTES, BlockHash


@dataclass(slots=True)
class LoadSpec:
    """Copy the blocks named ``hashes[shard]`` from the daemon into ``block_ids``."""

    req_id: str
    block_ids: list[int]
    hashes: tuple[bytes, ...]
    sync: bool
    """True: the request runs this step, so the copy lands before its forward pass."""
    group: int = 0
    """The KV cache group of ``block_ids``."""


@dataclass(slots=True)
class StoreSpec:
    """Copy the newly full ``block_ids`` into the daemon under ``hashes[shard]``."""

    req_id: str
    block_ids: list[int]
    hashes: tuple[bytes, ...]
    group: int = 0
    """The KV cache group of ``block_ids``."""
    metas: tuple[bytes, ...] = ()
    """Per block, its vLLM identity (``events.identities``), stored with shard 0."""


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """One step's loads and stores, and the requests whose blocks the workers must mind."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    """Requests preempted this step: their freed blocks may be rewritten by this step, so
    stores still reading them must be ordered first."""
    delay_free: set[str] = field(default_factory=set)
    """Finished requests whose blocks vLLM keeps until a worker reports them in
    ``finished_sending`` (after every store reading them has landed)."""
    new_blocks: set[int] = field(default_factory=set)
    """Blocks vLLM handed out this step, of a model whose sliding-window groups free blocks
    while their requests run: a store still reading one of them must land before this step's
    forward pass writes it."""


def pack(hashes: list[BlockHash]) -> bytes:
    return b"".join(hashes)


def unpack(packed: bytes) -> list[BlockHash]:
    if len(packed) % HASH_BYTES:
        raise ValueError(f"packed hashes are {len(packed)} bytes, not a multiple of {HASH_BYTES}")
    return [packed[i : i + HASH_BYTES] for i in range(0, len(packed), HASH_BYTES)]
