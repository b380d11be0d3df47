"""The longest hit every KV cache group can serve, found with the daemon's prefix lookups.

vLLM's own rule is the reference (``find_longest_cache_hit`` of each spec's manager, made
one by the hybrid coordinator): a hit ending at token ``h`` needs, in every group, every
block from the group's window start for ``h`` up to ``h`` — all of them for full attention;
the last ``ceil((W - 1) / B)`` for a sliding window of ``W`` tokens; those of ``h``'s chunk
for chunked local attention. Blocks that slid out are neither required nor loaded. Blocks
below ``start`` (vLLM's own GPU hit) are vLLM's. The hit is a multiple of every group's block
size.

The daemon answers one question: of these hashes, how many does it hold from the first on.
The first round asks it, per group and shard (of a tensor-parallel rank and pipeline stage),
about every block from ``start`` to the end; that settles full attention, and a window group
whose blocks are all there. Where a window group's answer stops short of the window a
candidate hit needs, the next round asks about that window alone; a block known missing
lowers the candidate to just before it. Each round starts from the last answer's callback, so
the scheduler never waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvtier.connector.vllm.groups import KVGroup
from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.lower import LowerHits

UNKNOWN, HELD, MISSING = 0, 1, 2

Ask = Callable[["Chain", list[BlockHash], Callable[[LowerHits], None]], None]
"""Starts a prefix lookup of these hashes of a chain and hands its answer to the callback, at
once or from another thread (``DaemonClient.lookup_then``); trouble is a miss, never an
exception."""


@dataclass(frozen=True, slots=True)
class Hit:
    """Tokens beyond ``start`` that every group can serve, and how many of them the host and
    disk tiers hold (the rest is on the remote tier)."""

    tokens: int = 0
    host_tokens: int = 0
    disk_tokens: int = 0

    @property
    def remote_tokens(self) -> int:
        return self.tokens - self.host_tokens - self.disk_tokens


class Chain:
    """One group's hashes for one shard, and what the daemon is known to hold of them.

    ``signature`` is the layout its blocks are stored under: the group's, or under pipeline
    parallelism its shard's stage's (a stage holds its own number of layers)."""

    __slots__ = ("first_answer", "group", "hashes", "known", "signature")

    def __init__(self, group: KVGroup, hashes: Sequence[BlockHash], signature: bytes | None = None):
        self.group = group
        self.signature = signature if signature is not None else group.layout.signature
        self.hashes = list(hashes)
        self.known = bytearray(len(self.hashes))
        self.first_answer: LowerHits | None = None

    def learn(self, first: int, asked: int, hits: LowerHits) -> None:
        """The daemon holds ``hits.total`` blocks from ``first`` on, of ``asked``."""
        held = min(hits.total, asked)
        self.known[first : first + held] = bytes([HELD]) * held
        if held < asked:
            self.known[first + held] = MISSING


def longest_hit(
    chains: Sequence[Chain], start: int, end: int, align: int
) -> tuple[int, list[tuple[Chain, int, int]]]:
    """The longest hit end in ``[start, end]`` (tokens, a multiple of ``align``) that what is
    known allows, and the ranges of blocks ``(chain, first, last)`` still to ask about before
    it is certain (none: it is)."""
    h = end // align * align
    while h > start:
        probes: list[tuple[Chain, int, int]] = []
        lowered = False
        for chain in chains:
            size = chain.group.block_size
            first = max(start // size, chain.group.first_needed_block(h))
            last = h // size
            window = chain.known[first:last]
            miss = window.find(MISSING)
            if miss >= 0:
                # Every shorter hit's window reaches back at least as far: it must end here.
                h = (first + miss) * size // align * align
                lowered = True
                break
            unknown = window.find(UNKNOWN)
            if unknown >= 0:
                probes.append((chain, first + unknown, last))
        if not lowered:
            return h, probes
    return start, []


class HitSearch:
    """Finds the hit of one request from ``start`` to ``end`` tokens; ``result`` resolves to
    a ``Hit`` once every group agrees. Answers arrive on the client's threads."""

    def __init__(self, chains: Sequence[Chain], start: int, end: int, align: int, ask: Ask):
        self.chains = list(chains)
        self.start, self.end, self.align = start, end, align
        self.result: Future[Hit] = Future()
        self._ask = ask
        self._lock = threading.Lock()
        self._pending = 0
        # The tier split is read off the first full-attention chain (all of its blocks from
        # `start` are loaded), as vLLM counts each hit token once.
        full = [c for c in self.chains if not c.group.windowed]
        self._reference = (full or self.chains)[0]
        self._send([(c, start // c.group.block_size, end // c.group.block_size) for c in chains])

    def _send(self, probes: list[tuple[Chain, int, int]]) -> None:
        with self._lock:
            self._pending = len(probes)
        for chain, first, last in probes:
            self._ask(
                chain,
                chain.hashes[first:last],
                lambda hits, chain=chain, first=first, n=last - first: self._answered(
                    chain, first, n, hits
                ),
            )

    def _answered(self, chain: Chain, first: int, asked: int, hits: LowerHits) -> None:
        with self._lock:
            chain.learn(first, asked, hits)
            if chain.first_answer is None:
                chain.first_answer = hits
            self._pending -= 1
            if self._pending:
                return
            h, probes = longest_hit(self.chains, self.start, self.end, self.align)
        if probes:
            self._send(probes)
            return
        tokens = h - self.start
        ref = self._reference
        answer, size = ref.first_answer or LowerHits(), ref.group.block_size
        host = min(answer.host * size, tokens)
        disk = min(answer.disk * size, tokens - host)
        self.result.set_result(Hit(tokens, host, disk))
