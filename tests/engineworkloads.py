"""The real-engine tests' workloads (``test_vllm_engine``): token-id prompts and their answer
lengths, cut to the engine's block size. Every pass's outputs are compared with an engine's
without kvtier on the same workload."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32
"""Tokens per vLLM block (the CPU attention backend wants multiples of 32)."""


# ---------------------------------------------------------------- workloads


def tokens(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 1000, n)]


DOCS = [tokens(1000 + i, 5 * BLOCK) for i in range(16)]
"""16 shared prefixes of 5 blocks: 80 blocks, twice the GPU cache, more than the host tier."""


UPGRADE_ANSWER_TOKENS = 128
"""Tokens each upgrade pass's request generates: four run at once in vLLM's cache, so a
pass lasts three waves of 128 decode steps."""


def ask(docs: list[list[int]], seed: int) -> list[list[int]]:
    """Each doc followed by a question of its own (the question never fills a block)."""
    return [doc + tokens(seed * 100 + i, 12) for i, doc in enumerate(docs)]


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: int | list[int]
    """One answer length for every prompt, or one per prompt."""

    def requests(self) -> list[tuple[list[int], int]]:
        """Each prompt with its answer length."""
        lengths = self.max_tokens
        if isinstance(lengths, int):
            lengths = [lengths] * len(self.prompts)
        return list(zip(self.prompts, lengths, strict=True))


WORKLOADS = {
    # Stores every doc; the GPU cache keeps only the last few.
    "first": Workload(ask(DOCS, 1), 16),
    # The docs again, newest first: GPU hits, then host-tier hits, then disk-tier hits.
    "again": Workload(ask(DOCS[::-1], 2), 16),
    # Other prefixes: pushes the docs out of vLLM's cache.
    "flush": Workload(ask([tokens(2000 + i, 5 * BLOCK) for i in range(10)], 3), 16),
    "restart": Workload(ask(DOCS, 4), 16),
    # Twice as many requests, so that a fault can land in the middle of a pass.
    "fault_normal": Workload(ask(DOCS * 2, 5), 16),
    "fault_kill": Workload(ask(DOCS * 2, 6), 16),
    "fault_after_kill": Workload(ask(DOCS[::-1] * 2, 7), 16),
    # Under a frozen daemon every request may wait out call deadlines: a shorter pass.
    "stop_normal": Workload(ask(DOCS, 10), 16),
    "fault_stop": Workload(ask(DOCS, 8), 16),
    "fault_after_stop": Workload(ask(DOCS[::-1], 9), 16),
    # Less than a block: a step of the engine that stores and loads nothing.
    "nudge": Workload([tokens(7000, 12)], 1),
    # 16 requests that each grow to 15 blocks in a 40-block cache: preempted again and again.
    "preempt": Workload([tokens(3000, 2 * BLOCK) + tokens(3100 + i, 40) for i in range(16)], 360),
    # New prefixes (50 blocks each pass, more than vLLM's cache) stored while the daemon
    # restarts under them. Long answers keep requests running across the restart: their
    # prefixes are stored at prefill, and some hundred decode steps are still to come when
    # the test has seen the first ones stored and restarts the daemon.
    **{
        f"upgrade_{n}": Workload(
            ask([tokens(6000 + 100 * n + i, 5 * BLOCK) for i in range(10)], 20 + n),
            UPGRADE_ANSWER_TOKENS,
        )
        for n in range(3)
    },
}
PROBE_TAIL = tokens(5000, 12)
PROBE = Workload([doc + PROBE_TAIL for doc in DOCS[:6]], 16)
"""Prompts that differ only before their last block."""

ABORT_SHARED = tokens(4000, 2 * BLOCK)
"""The prefix the aborted request finds in vLLM's own cache."""
ABORT_TAILS = [tokens(4100 + i, 3 * BLOCK) for i in range(3)]
"""Blocks the aborted request finds only in kvtier (one per attempt)."""
ABORT_WORKLOADS = {
    "abort_store": Workload([ABORT_SHARED + tail + tokens(4200, 5) for tail in ABORT_TAILS], 8),
    "abort_flush": Workload(ask([tokens(4300 + i, 5 * BLOCK) for i in range(10)], 41), 8),
    "abort_shared": Workload([ABORT_SHARED + tokens(4400, 7)], 8),
    # After the abort: the aborted prompts (their blocks must be sound) and new requests.
    "abort_after": Workload(
        [ABORT_SHARED + tail + tokens(4500 + i, 9) for i, tail in enumerate(ABORT_TAILS)]
        + ask(DOCS[:4], 42),
        16,
    ),
}
ABORT_VICTIM = [ABORT_SHARED + tail + tokens(4600, 6) for tail in ABORT_TAILS]
