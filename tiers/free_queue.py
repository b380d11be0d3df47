"""The GPU pool's free queue: an intrusive doubly linked list of blocks, LRU at the head.

The links live in the blocks themselves and two sentinels bound the list, so removing a block
from the middle (a cache hit on a free block) is O(1), allocates nothing and needs no branch
for the ends.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, eq=False)
class KVBlock:
    """One GPU block: its id, reference count, hash once full, and its free-queue links."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)
    pending_read: Any = field(default=None, repr=False)
    """The in-flight copy reading this block's content (a spill); its next writer waits on it."""
    below: bool = False
    """The tier below already holds this block's content, so recycling it copies nothing."""

    @property
    def is_free_listed(self) -> bool:
        return self.prev_free is not None


class FreeBlockQueue:
    """Blocks with no reference, least recently used first."""

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Sequence[KVBlock]):
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        self.append_n(blocks)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free block")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        if n > self.num_free:
            raise ValueError(f"asked for {n} free blocks, {self.num_free} are free")
        # Unlink the whole run at once rather than n single removals.
        out: list[KVBlock] = []
        block = self._head.next_free
        for _ in range(n):
            nxt = block.next_free
            block.prev_free = block.next_free = None
            out.append(block)
            block = nxt
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free -= n
        return out

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def append_n(self, blocks: Sequence[KVBlock]) -> None:
        for block in blocks:
            self.append(block)

    def iter_from_head(self) -> Iterator[KVBlock]:
        """Free blocks from the least recently used; do not mutate the queue while iterating."""
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free
