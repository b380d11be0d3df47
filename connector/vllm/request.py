"""One vLLM request as the scheduler side sees it: its state, and kvtier's block hashes of it
for every KV cache group and tensor-parallel shard.

The chain covers the request's token ids as they grow (prompt, then output tokens for blocks
stored during decode); the LoRA adapter's key (its content, ``adapters``), multimodal
inputs and ``cache_salt`` of the request enter as ``ExtraKeys``, so a salted or LoRA request
shares nothing it should not.

vLLM may also take tokens back: a streaming-input session drops the last sampled token and
the block hashes over it when its next chunk arrives. The chain follows vLLM's own
``request.block_hashes``: it remembers vLLM's hash of each block it hashed, keeps the longest
prefix vLLM still agrees with, and hashes on from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.connector.vllm.hits import Hit
from kvtier.connector.vllm.lookup import Lookup
from kvtier.connector.vllm.metadata import pack
from kvtier.tiers.hashing import BlockHash, ExtraKeys, MultiModalInput, hash_block_chain


def extra_keys(request, lora: str | None) -> ExtraKeys:
    """The properties of a vLLM ``Request`` that change its blocks' meaning; ``lora`` is its
    adapter's key."""
    mm = tuple(
        MultiModalInput(f.mm_position.offset, f.mm_position.length, f.identifier)
        for f in request.mm_features or ()
    )
    return ExtraKeys(lora=lora, mm_inputs=mm, cache_salt=request.cache_salt)


class RequestHashes:
    """Per-shard chained hashes of a request's full blocks (of one KV cache group), as far as
    vLLM has hashed them.

    ``seeds`` are the root parents, one per shard. ``hash_block_size`` is the granularity of
    vLLM's ``request.block_hashes`` (it divides ``block_size``). ``lora`` is the key of the
    request's LoRA adapter (``adapters.AdapterKeys``).
    """

    __slots__ = ("_block_size", "_chains", "_cut", "_extra", "_marks", "_num_mm", "_per_block")

    def __init__(
        self,
        request,
        seeds: Sequence[BlockHash],
        block_size: int,
        hash_block_size: int | None = None,
        lora: str | None = None,
    ):
        hash_block_size = hash_block_size or block_size
        if block_size % hash_block_size:
            raise ValueError(
                f"vLLM hashes blocks of {hash_block_size} tokens, which does not divide "
                f"kvtier's block of {block_size}"
            )
        self._block_size = block_size
        self._per_block = block_size // hash_block_size
        self._chains: list[tuple[BlockHash, list[BlockHash]]] = [(seed, []) for seed in seeds]
        self._marks: list[object] = []  # vLLM's hash of each block's last hash block
        self._extra = extra_keys(request, lora)
        self._num_mm = len(request.mm_features or ())
        self._cut: int | None = None

    def __len__(self) -> int:
        return len(self._marks)

    def extend_to(self, request, num_blocks: int) -> int:
        """Follows vLLM's hashes of ``request``, then hashes blocks up to ``num_blocks`` (as
        far as vLLM has hashed them); returns the number of blocks hashed."""
        self._follow(request.block_hashes)
        have = len(self)
        end = min(num_blocks, len(request.block_hashes) // self._per_block)
        if end <= have:
            return have
        if len(request.mm_features or ()) != self._num_mm:  # a streamed chunk added inputs
            self._extra = extra_keys(request, self._extra.lora)
            self._num_mm = len(request.mm_features)
        size = self._block_size
        tokens = request.all_token_ids[have * size : end * size]
        for seed, chain in self._chains:
            parent = chain[-1] if chain else seed
            chain.extend(hash_block_chain(parent, tokens, size, self._extra, have))
        step = self._per_block
        self._marks.extend(request.block_hashes[(i + 1) * step - 1] for i in range(have, end))
        return end

    def reseed(self, seeds: Sequence[BlockHash]) -> None:
        """Starts the chains again from new root parents (every hash changes)."""
        self._chains = [(seed, []) for seed in seeds]
        self._truncate(0)

    def take_cut(self) -> int | None:
        """The fewest blocks the chain was cut back to since the last call (None: no cut)."""
        cut, self._cut = self._cut, None
        return cut

    def per_shard(self, start: int, end: int) -> list[list[BlockHash]]:
        """Every shard's hashes of blocks ``[start, end)``."""
        return [chain[start:end] for _, chain in self._chains]

    def packed(self, start: int, end: int) -> tuple[bytes, ...]:
        """Per shard, the packed hashes of blocks ``[start, end)``."""
        return tuple(pack(chain[start:end]) for _, chain in self._chains)

    def _follow(self, vllm_hashes: Sequence[object]) -> None:
        """Cuts the chain back to the blocks whose vLLM hash is still the one it hashed."""
        marks = self._marks
        if not marks or self._agrees(vllm_hashes, len(marks) - 1):
            return
        # vLLM's hashes are chained too, so they agree with the marks on a prefix: find its end.
        lo, hi = 0, len(marks) - 1  # marks[:lo] agree, marks[hi] does not
        while lo < hi:
            mid = (lo + hi) // 2
            if self._agrees(vllm_hashes, mid):
                lo = mid + 1
            else:
                hi = mid
        self._truncate(lo)

    def _agrees(self, vllm_hashes: Sequence[object], block: int) -> bool:
        index = (block + 1) * self._per_block - 1
        return index < len(vllm_hashes) and vllm_hashes[index] == self._marks[block]

    def _truncate(self, num_blocks: int) -> None:
        for _, chain in self._chains:
            del chain[num_blocks:]
        del self._marks[num_blocks:]
        self._cut = num_blocks if self._cut is None else min(self._cut, num_blocks)


@dataclass(slots=True)
class PlannedLoad:
    """A planned load whose outcome is not known yet."""

    start: int
    """The token it starts at (vLLM's own hit before it)."""
    block_ids: list[tuple[int, list[int]]]
    """Per KV cache group: the index of the first block it loads, and the vLLM block ids."""
    sync: bool


@dataclass(slots=True)
class RequestState:
    """What the scheduler side remembers of one request; lists hold one item per KV cache
    group."""

    request: object
    hashes: list[RequestHashes]
    block_ids: list[list[int]]
    stored_blocks: list[int]
    """Leading blocks already in kvtier or handed to the workers to store."""
    scheduled: bool = False
    """vLLM has scheduled it at least once (a later "new" scheduling resumes it)."""
    running: bool = False
    """It holds KV it computed since it was last admitted (not waiting, loading or preempted)."""
    lookup: Lookup | None = None
    offer: Hit | None = None
    """The hit last returned to vLLM, of tokens from ``offer_start`` on."""
    offer_start: int = 0
    declined: dict[str, int] | None = None
    """Tokens of ``offer`` per tier that the load gate left to recompute; counted when vLLM
    allocates for the request."""
    load: PlannedLoad | None = None
    verify_end: int = 0
    """Tokens vLLM must have processed before blocks computed over a sync load are stored."""
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    stores_issued: bool = False
    stale: bool = False
    """It holds KV from before ``reset_cache``: none of it may be stored any more."""

    @classmethod
    def new(cls, request, hashes: list[RequestHashes]) -> RequestState:
        groups = len(hashes)
        return cls(request, hashes, [[] for _ in range(groups)], [0] * groups)
