"""kvtier's block hashes of one vLLM request, for every tensor-parallel rank.

The chain covers the request's token ids as they grow (prompt, then output tokens for blocks
stored during decode); the LoRA name, multimodal inputs and ``cache_salt`` of the request
enter as ``ExtraKeys``, so a salted or LoRA request shares nothing it should not.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.connector.vllm_metadata import pack
from kvtier.tiers.hashing import BlockHasher, ExtraKeys, MultiModalInput, Namespace


def extra_keys(request) -> ExtraKeys:
    """The properties of a vLLM ``Request`` that change its blocks' meaning."""
    lora = request.lora_request.lora_name if request.lora_request is not None else None
    mm = tuple(
        MultiModalInput(f.mm_position.offset, f.mm_position.length, f.identifier)
        for f in request.mm_features or ()
    )
    return ExtraKeys(lora_name=lora, mm_inputs=mm, cache_salt=request.cache_salt)


class RequestHashes:
    """Per-rank chained hashes of a request's full blocks, extended on demand."""

    __slots__ = ("_block_size", "_hashers", "_seeds")

    def __init__(self, request, namespaces: Sequence[Namespace], block_size: int):
        extra = extra_keys(request)
        self._block_size = block_size
        self._hashers = [BlockHasher(ns, block_size, extra) for ns in namespaces]
        self._seeds = [ns.seed for ns in namespaces]

    def __len__(self) -> int:
        return len(self._hashers[0].hashes)

    def extend_to(self, token_ids: Sequence[int], num_blocks: int) -> int:
        """Hashes blocks up to ``num_blocks`` (as far as ``token_ids`` fill them); returns the
        number of blocks hashed."""
        have = len(self)
        end = min(num_blocks, len(token_ids) // self._block_size)
        if end > have:
            new = token_ids[have * self._block_size : end * self._block_size]
            for hasher in self._hashers:
                hasher.extend(new)
        return len(self)

    def rank0(self, start: int, end: int) -> list[bytes]:
        """Rank 0's hashes of blocks ``[start, end)`` (what the scheduler looks up)."""
        return self._hashers[0].hashes[start:end]

    def packed(self, start: int, end: int) -> tuple[bytes, ...]:
        """Per rank, the packed hashes of blocks ``[start, end)``."""
        return tuple(pack(h.hashes[start:end]) for h in self._hashers)

    def packed_parents(self, start: int, end: int) -> tuple[bytes, ...]:
        """Per rank, the packed parent hash of each block in ``[start, end)``."""
        out = []
        for hasher, seed in zip(self._hashers, self._seeds, strict=True):
            chain = hasher.hashes
            parents = chain[start - 1 : end - 1] if start > 0 else [seed, *chain[: end - 1]]
            out.append(pack(parents))
        return tuple(out)
