"""Pool + host + disk driven by random engine steps against a simple model.

The model keeps the GPU free queue as a plain list, the host tier as an LRU ordered dict and
the disk as a set (its budget is large enough never to evict here), and replays the same
decisions the tiers make. After every step the real stack must agree with it on: reference
counts, free-queue order, findability of hashed free blocks, and the tier every block ever
computed is found in. With the spill-ahead window on, the exact order of background spills is
not modelled; that machine, whose host tier is larger than the GPU pool as in production,
checks instead that nothing is lost and nothing is spilled twice. The modelled machine's host
tier is smaller than one request's loads plus spills, so it also runs out of slots (blocks are
then dropped, and the model says so).
"""

from __future__ import annotations

import random
from collections import OrderedDict

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.tiers.hashing import Namespace, hash_prompt
from kvtier.tiers.layout import KVLayout
from kvtier.tiers.stack import build_local_stack

from tierutil import block_content, compute_blocks, read_blocks

BS = 4
GPU_BLOCKS = 8
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, block_size=BS, dtype=torch.float16)
NS = Namespace("stateful", LAYOUT.signature)
FAMILIES = [[random.Random(f).randrange(1000) for _ in range(4 * BS)] for f in range(4)]


def make_tokens(family: int, shared_blocks: int, suffix_seed: int, suffix_len: int) -> list[int]:
    rng = random.Random(1000 + suffix_seed)
    return FAMILIES[family][: shared_blocks * BS] + [rng.randrange(1000) for _ in range(suffix_len)]


class Model:
    """The tiers' decisions, written the plain way."""

    def __init__(self, disk: set[bytes], host_slots: int):
        self.host_slots = host_slots
        self.free = list(range(GPU_BLOCKS))
        self.ref = [0] * GPU_BLOCKS
        self.hash: list[bytes | None] = [None] * GPU_BLOCKS
        self.cached: dict[bytes, int] = {}
        self.host: OrderedDict[bytes, None] = OrderedDict()  # committed, unpinned, LRU first
        self.busy: set[bytes] = set()  # host slots pinned or being written
        self.disk = disk
        self.spilled = 0
        self.dropped = 0

    def host_has(self, h: bytes) -> bool:
        return h in self.host or h in self.busy

    def take_slot(self) -> bool:
        if len(self.host) + len(self.busy) < self.host_slots:
            return True
        if not self.host:
            return False
        victim, _ = self.host.popitem(last=False)
        self.disk.add(victim)
        return True

    def spill(self, hashes: list[bytes]) -> None:
        written = []
        for h in hashes:
            if self.host_has(h) or h in self.disk:
                continue
            if self.take_slot():
                self.busy.add(h)
                written.append(h)
            else:
                self.dropped += 1
        for h in reversed(written):  # a batch is committed tail first into the LRU
            self.busy.discard(h)
            self.host[h] = None
        self.spilled += len(written)

    def pop_free(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        self.spill([self.hash[b] for b in taken if self.hash[b] is not None])
        for b in taken:
            if self.hash[b] is not None:
                del self.cached[self.hash[b]]
                self.hash[b] = None
            self.ref[b] = 1
        return taken

    def cache(self, blocks: list[int], hashes: list[bytes]) -> None:
        for b, h in zip(blocks, hashes, strict=True):
            if self.hash[b] is None and h not in self.cached:
                self.hash[b] = h
                self.cached[h] = b

    def serve(self, hashes: list[bytes], num_tokens: int) -> tuple[list[int], tuple[int, int, int]]:
        claimable = min(len(hashes), (num_tokens - 1) // BS)
        gpu = []
        for h in hashes[:claimable]:
            if h not in self.cached:
                break
            gpu.append(self.cached[h])
        lower = []
        for h in hashes[len(gpu) : claimable]:
            if h in self.host:
                lower.append("h")
            elif h in self.disk:
                lower.append("d")
            else:
                break
        # The lookup makes its host hits the most recently used, the prefix's head last.
        looked_up = hashes[len(gpu) : len(gpu) + len(lower)]
        for h in reversed([h for h, tier in zip(looked_up, lower, strict=True) if tier == "h"]):
            self.host.move_to_end(h)
        for b in gpu:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
        blocks, n = list(gpu), 0
        if lower and len(self.free) >= len(lower):
            # The acquire pins every host hit first, then promotes the disk hits in order.
            resident = [h for h in looked_up if h in self.host]
            for h in resident:
                del self.host[h]
                self.busy.add(h)
            pinned = []
            for h in looked_up:
                if h not in resident:
                    if not self.take_slot():
                        break
                    self.busy.add(h)
                pinned.append(h)
            n = len(pinned)
            for h in resident:
                if h not in pinned:  # beyond a failed promotion: unpinned again
                    self.busy.discard(h)
                    self.host[h] = None
            new = self.pop_free(n) if n else []
            for h in reversed(pinned):  # released tail first
                self.busy.discard(h)
                self.host[h] = None
            self.cache(new, hashes[len(gpu) : len(gpu) + n])
            blocks += new
        host_hits = min(lower.count("h"), n)
        computed = self.pop_free(len(hashes) - len(blocks))
        self.cache(computed, hashes[len(blocks) :])
        return blocks + computed, (len(gpu), host_hits, n - host_hits)

    def finish(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)

    def held(self) -> set[bytes]:
        """Every hash some tier holds."""
        return set(self.cached) | set(self.host) | self.busy | self.disk

    def tier_of(self, h: bytes) -> str:
        if h in self.cached:
            return "gpu"
        if self.host_has(h):
            return "host"
        return "disk" if h in self.disk else "none"


class TierMachine(RuleBasedStateMachine):
    spill_ahead = 0
    host_slots = 6

    def __init__(self):
        super().__init__()
        import tempfile

        self.dir = tempfile.TemporaryDirectory()
        self.stack = self._open()
        self.model = Model(set(), self.host_slots)
        self.active: list[tuple[list, list[bytes]]] = []
        self.seen: set[bytes] = set()
        self.host_stores: dict[bytes, int] = {}

    def _open(self):
        stack = build_local_stack(
            LAYOUT,
            GPU_BLOCKS,
            host_bytes=self.host_slots * LAYOUT.block_bytes,
            disk_path=self.dir.name,
            disk_bytes=10_000 * LAYOUT.block_bytes,
            spill_ahead=self.spill_ahead,
        )
        reserve = stack.lower.reserve

        def counted_reserve(hashes, metas=()):
            """Counts each store the host tier took on (promotions from disk are not stores)."""
            slots = reserve(hashes, metas)
            for block_hash, slot in zip(hashes, slots, strict=True):
                if slot >= 0:
                    self.host_stores[block_hash] = self.host_stores.get(block_hash, 0) + 1
            return slots

        stack.lower.reserve = counted_reserve
        return stack

    def teardown(self):
        self.stack.close(persist=False)
        self.dir.cleanup()

    @precondition(lambda self: len(self.active) < 3)
    @rule(
        family=st.integers(0, 3),
        shared=st.integers(0, 4),
        suffix_seed=st.integers(0, 5),
        suffix_len=st.integers(1, 8),
    )
    def serve(self, family, shared, suffix_seed, suffix_len):
        tokens = make_tokens(family, shared, suffix_seed, suffix_len)
        hashes = hash_prompt(NS, tokens, BS)
        if self.stack.pool.num_free < len(hashes):
            return
        stack = self.stack
        match = stack.cache.match(hashes, len(tokens))
        claimed = stack.cache.claim(match)
        n = len(claimed.blocks)
        if n:
            want = torch.stack([block_content(h, LAYOUT.block_bytes) for h in hashes[:n]])
            assert torch.equal(read_blocks(stack, claimed.blocks), want), "wrong block loaded"
        new = stack.pool.get_new_blocks(len(hashes) - n)
        compute_blocks(stack, new, hashes[n:])
        blocks = claimed.blocks + new
        self.active.append((blocks, hashes))
        self.seen.update(hashes)
        if self.spill_ahead == 0:
            model_blocks, hits = self.model.serve(hashes, len(tokens))
            assert [b.block_id for b in blocks] == model_blocks
            assert (claimed.gpu_hits, claimed.host_hits, claimed.disk_hits) == hits

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def finish(self, data):
        i = data.draw(st.integers(0, len(self.active) - 1))
        blocks, _ = self.active.pop(i)
        self.stack.pool.free_blocks(reversed(blocks))
        if self.spill_ahead == 0:
            self.model.finish([b.block_id for b in blocks])

    @precondition(lambda self: not self.active)
    @rule()
    def reopen(self):
        self.stack.close()
        self.stack = self._open()
        # A graceful close pushes every GPU and host block to the disk; dropped ones stay lost.
        kept = self.seen if self.spill_ahead else self.model.held()
        self.model = Model(set(kept), self.host_slots)
        self.host_stores.clear()

    @invariant()
    def referenced_blocks_hold_their_bytes(self):
        for blocks, hashes in self.active:
            for b in blocks:
                assert b.ref_cnt > 0 and not b.is_free_listed
            if not blocks:
                continue
            want = torch.stack([block_content(h, LAYOUT.block_bytes) for h in hashes])
            assert torch.equal(read_blocks(self.stack, blocks), want), "held block overwritten"

    @invariant()
    def free_hashed_blocks_are_findable(self):
        pool = self.stack.pool
        for block in pool.free_queue.iter_from_head():
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                assert pool.get_cached_block(block.block_hash) is block

    @invariant()
    def nothing_computed_is_lost_or_spilled_twice(self):
        assert all(count == 1 for count in self.host_stores.values())
        if not self.spill_ahead:
            return  # the model decides which blocks were dropped
        host, disk = self.stack.lower, self.stack.disk
        for h in self.seen:
            found = self.stack.pool.get_cached_block(h) or host.contains(h) or disk.contains(h)
            assert found, "a computed block vanished from every tier"
        assert self.stack.pool.counters.blocks_dropped == 0

    @invariant()
    def matches_the_model(self):
        if self.spill_ahead:
            return
        pool, model = self.stack.pool, self.model
        assert [b.block_id for b in pool.free_queue.iter_from_head()] == model.free
        assert [b.ref_cnt for b in pool.blocks] == model.ref
        assert pool.counters.blocks_spilled == model.spilled
        assert pool.counters.blocks_dropped == model.dropped
        host, disk = self.stack.lower, self.stack.disk
        for h in self.seen:
            if pool.get_cached_block(h) is not None:
                tier = "gpu"
            elif host.contains(h):
                tier = "host"
            else:
                tier = "disk" if disk.contains(h) else "none"
            assert tier == model.tier_of(h), f"block {h.hex()} in {tier}, model {model.tier_of(h)}"


class SpillAheadMachine(TierMachine):
    spill_ahead = 3
    host_slots = 16


RUN = settings(max_examples=40, stateful_step_count=60, deadline=None)
TestTiersAgainstModel = TierMachine.TestCase
TestTiersAgainstModel.settings = RUN
TestTiersWithSpillAhead = SpillAheadMachine.TestCase
TestTiersWithSpillAhead.settings = RUN
