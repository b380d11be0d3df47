"""The GPU block pool: ref-counted blocks, a hash index, and a lazy LRU that spills.

Shaped like vLLM's block pool. A freed block keeps its hash and stays findable until
``get_new_blocks`` recycles it; at that moment its content is copied to the tier below instead
of being lost (unless that tier already holds it), on the copy engine's store stream. The
block's next writer waits for that copy through ``pending_reads``. A spill-ahead window copies
the coldest few hashed free blocks in the background, so that recycling rarely waits at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.free_queue import FreeBlockQueue, KVBlock
from kvtier.tiers.gpu.copy_engine import CopyEngine
from kvtier.tiers.gpu.transfer import Transfer
from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.lower import ALREADY_STORED, NOT_ADMITTED, LowerTier


class BlockSpiller:
    """Copies hashed GPU blocks into reserved host slots and commits them when they land."""

    def __init__(self, lower: LowerTier, engine: CopyEngine, counters: TierCounters):
        self.lower = lower
        self.engine = engine
        self.counters = counters

    def spill(self, blocks: Sequence[KVBlock]) -> None:
        """Spills ``blocks`` (hashed, not yet below); marks each as below once handled."""
        slots = self.lower.reserve([b.block_hash for b in blocks])
        ids: list[int] = []
        taken: list[int] = []
        copied: list[KVBlock] = []
        for block, slot in zip(blocks, slots, strict=True):
            block.below = True
            if slot >= 0:
                ids.append(block.block_id)
                taken.append(slot)
                copied.append(block)
            elif slot == ALREADY_STORED:
                self.counters.blocks_deduplicated += 1
            elif slot != NOT_ADMITTED:  # one turned away is not offered again: no new sighting
                block.below = False  # every slot below is busy: the content is dropped
                self.counters.blocks_dropped += 1
        if not copied:
            return
        lower = self.lower
        transfer = self.engine.store(ids, taken, callback=lambda: lower.commit(taken))
        for block in copied:
            block.pending_read = transfer
        self.counters.blocks_spilled += len(copied)


class GpuBlockPool:
    """Fixed set of GPU blocks with prefix-cache semantics; metadata only, data lives in KV."""

    def __init__(
        self,
        num_blocks: int,
        *,
        spiller: BlockSpiller | None = None,
        spill_ahead: int = 4,
        counters: TierCounters | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if spill_ahead < 0:
            raise ValueError(f"spill_ahead must be >= 0, got {spill_ahead}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.spiller = spiller
        self.spill_ahead = spill_ahead
        self.counters = counters or TierCounters("gpu")
        self.counters.capacity_blocks = num_blocks

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def match_prefix(self, hashes: Iterable[BlockHash]) -> list[KVBlock]:
        """The cached blocks of the longest prefix of ``hashes``; takes no reference."""
        out: list[KVBlock] = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes a reference on each block, rescuing cached free blocks from eviction."""
        for block in blocks:
            if block.ref_cnt == 0 and block.is_free_listed:
                self.free_queue.remove(block)
            block.ref_cnt += 1
        self._update_usage()

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pops ``n`` blocks from the LRU end, spilling the hashed ones they held.

        The caller must order its writes after ``pending_reads(blocks)``.
        """
        if self.spiller is not None:
            self.spiller.engine.poll()
        blocks = self.free_queue.popleft_n(n)
        to_spill = [b for b in blocks if b.block_hash is not None and not b.below]
        if to_spill and self.spiller is not None:
            self.spiller.spill(to_spill)
        for block in blocks:
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
                self.counters.blocks_evicted += 1
            block.below = False
            block.ref_cnt = 1
        self._spill_ahead()
        self._update_usage()
        return blocks

    def cache_full_blocks(self, blocks: Sequence[KVBlock], hashes: Sequence[BlockHash]) -> None:
        """Names full blocks by their hashes so later requests find them.

        A hash already cached in another block stays with that block; the duplicate is simply
        not indexed and is recycled like any unhashed block.
        """
        for block, block_hash in zip(blocks, hashes, strict=True):
            if block.block_hash is not None:
                if block.block_hash != block_hash:
                    raise ValueError(f"block {block.block_id} already holds another hash")
                continue
            if block_hash in self.cached:
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block
            self.counters.blocks_stored += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference from each block; pass a request's blocks tail first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
        self._spill_ahead()
        self._update_usage()

    def spill_cached(self) -> None:
        """Spills every hashed block the tier below lacks, and waits (graceful shutdown).

        Batches stay within half the lower tier's slots and each is committed before the next,
        so the lower tier can always make room by pushing its own LRU blocks further down.
        """
        if self.spiller is None:
            return
        blocks = [b for b in self.cached.values() if not b.below]
        step = max(1, self.spiller.lower.counters.capacity_blocks // 2)
        for start in range(0, len(blocks), step):
            self.spiller.spill(blocks[start : start + step])
            self.spiller.engine.synchronize()

    @staticmethod
    def pending_reads(blocks: Iterable[KVBlock]) -> list[Transfer]:
        """In-flight copies still reading these blocks' old content; clears finished ones."""
        pending: list[Transfer] = []
        for block in blocks:
            transfer = block.pending_read
            if transfer is None:
                continue
            if transfer.done():
                block.pending_read = None
            else:
                pending.append(transfer)
        return pending

    def _spill_ahead(self) -> None:
        if not self.spill_ahead or self.spiller is None:
            return
        window: list[KVBlock] = []
        for i, block in enumerate(self.free_queue.iter_from_head()):
            if i >= self.spill_ahead:
                break
            if block.block_hash is not None and not block.below:
                window.append(block)
        if window:
            self.spiller.spill(window)

    def _update_usage(self) -> None:
        used = len(self.blocks) - self.free_queue.num_free
        self.counters.used_blocks = used
