"""The fall-through prefix walk: GPU, then host, then disk, then recompute.

``match`` finds the longest contiguous prefix of a request's block hashes that some tier holds
(the GPU index first, then ONE batched query of the lower tiers for the rest), never claiming
the block that holds the last prompt token, since the engine needs one real forward pass for
its logits. ``claim`` then takes the GPU hits, allocates GPU blocks for the lower-tier hits,
acquires their host slots (promoting disk hits on the way) and starts one host→GPU copy;
the engine waits on the returned transfer before attention reads those blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.free_queue import KVBlock
from kvtier.tiers.gpu.copy_engine import CopyEngine
from kvtier.tiers.gpu.transfer import Transfer
from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.host.tier import LowerHits
from kvtier.tiers.lower import LowerTier
from kvtier.tiers.pool import GpuBlockPool


@dataclass(slots=True)
class PrefixMatch:
    """What each tier can supply for one request; taking it is ``PrefixCache.claim``."""

    hashes: list[BlockHash]
    num_prompt_tokens: int
    gpu_blocks: list[KVBlock]
    lower: LowerHits = field(default_factory=LowerHits)

    @property
    def num_blocks(self) -> int:
        return len(self.gpu_blocks) + self.lower.total

    def truncate(self, num_blocks: int) -> PrefixMatch:
        """This match cut to its first ``num_blocks`` blocks (GPU hits, then host, then disk)."""
        gpu = self.gpu_blocks[:num_blocks]
        rest = num_blocks - len(gpu)
        host = min(self.lower.host, rest)
        lower = LowerHits(host=host, disk=min(self.lower.disk, rest - host))
        return PrefixMatch(self.hashes[:num_blocks], self.num_prompt_tokens, gpu, lower)


@dataclass(slots=True)
class ClaimedPrefix:
    """GPU blocks now holding the prefix (one reference each) and the copy to wait on."""

    blocks: list[KVBlock]
    gpu_hits: int
    host_hits: int
    disk_hits: int
    transfer: Transfer | None = None

    def wait(self) -> None:
        """Blocks the host until loaded blocks are in place (no-op on CPU)."""
        if self.transfer is not None:
            self.transfer.wait()


@dataclass(slots=True)
class WalkCounters:
    """The counters the walk adds query and hit tokens to, one per tier."""

    gpu: TierCounters
    host: TierCounters
    disk: TierCounters

    def tiers(self) -> tuple[TierCounters, TierCounters, TierCounters]:
        return self.gpu, self.host, self.disk


class PrefixCache:
    """A GPU pool with optional lower tiers behind it, walked as one cache."""

    def __init__(
        self,
        pool: GpuBlockPool,
        block_size: int,
        *,
        lower: LowerTier | None = None,
        engine: CopyEngine | None = None,
        disk_counters: TierCounters | None = None,
    ):
        if (lower is None) != (engine is None):
            raise ValueError("lower tiers and a copy engine come together")
        self.pool = pool
        self.block_size = block_size
        self.lower = lower
        self.engine = engine
        host = lower.counters if lower is not None else TierCounters("host")
        self.counters = WalkCounters(pool.counters, host, disk_counters or TierCounters("disk"))

    def match(self, hashes: Sequence[BlockHash], num_prompt_tokens: int) -> PrefixMatch:
        """Longest prefix any tier holds; no side effects, so it may be asked again."""
        claimable = min(len(hashes), max(num_prompt_tokens - 1, 0) // self.block_size)
        wanted = list(hashes[:claimable])
        gpu = self.pool.match_prefix(wanted)
        result = PrefixMatch(wanted, num_prompt_tokens, gpu)
        if self.lower is not None and len(gpu) < claimable:
            result.lower = self.lower.lookup(wanted[len(gpu) :])
        return result

    def claim(self, match: PrefixMatch) -> ClaimedPrefix:
        """Takes the matched prefix: references GPU hits, loads lower-tier hits into new blocks.

        Fewer blocks may come back than matched if a lower-tier block vanished in between or
        failed its checksum; the walk then stops there and the rest is recomputed.
        """
        bs = self.block_size
        gpu_blocks = match.gpu_blocks
        self.pool.touch(gpu_blocks)
        claimed = ClaimedPrefix(list(gpu_blocks), len(gpu_blocks), 0, 0)
        wanted = match.lower.total
        if wanted and self.pool.num_free >= wanted:
            self._load_lower(match, claimed)
        gpu_c, host_c, disk_c = self.counters.tiers()
        gpu_c.query_tokens += match.num_prompt_tokens
        gpu_c.hit_tokens += claimed.gpu_hits * bs
        host_c.query_tokens += match.num_prompt_tokens - claimed.gpu_hits * bs
        host_c.hit_tokens += claimed.host_hits * bs
        disk_c.query_tokens += match.num_prompt_tokens - (claimed.gpu_hits + claimed.host_hits) * bs
        disk_c.hit_tokens += claimed.disk_hits * bs
        return claimed

    def _load_lower(self, match: PrefixMatch, claimed: ClaimedPrefix) -> None:
        start = len(match.gpu_blocks)
        hashes = match.hashes[start : start + match.lower.total]
        slots = self.lower.acquire(hashes)
        if not slots:
            return
        blocks = self.pool.get_new_blocks(len(slots))
        lower = self.lower
        claimed.transfer = self.engine.load(
            slots,
            [b.block_id for b in blocks],
            after=self.pool.pending_reads(blocks),
            callback=lambda: lower.release(slots),
        )
        self.pool.cache_full_blocks(blocks, hashes[: len(slots)])
        claimed.blocks.extend(blocks)
        claimed.host_hits = min(match.lower.host, len(slots))
        claimed.disk_hits = len(slots) - claimed.host_hits
