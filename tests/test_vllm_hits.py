"""kvtier's hit across KV cache groups agrees with vLLM's own rule, case by case.

The reference is vLLM's ``find_longest_cache_hit`` of each spec's manager (full
attention, sliding window, chunked local attention), made one hit by the hybrid
coordinator's fixed point, over a block pool that holds a random subset of each group's
blocks. kvtier asks the daemon only "how many of these hashes from the first do you hold";
here a fake daemon answers from the same subsets, and ``HitSearch`` must find the same hit.

Run in the vLLM venv: ``VLLM_TARGET_DEVICE=cpu pytest -m vllm tests/test_vllm_hits.py``.
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")

import torch
from vllm.v1.core.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)

from kvtier.connector.vllm.groups import alignment_tokens, groups_from_kv_cache_config
from kvtier.connector.vllm.hits import Chain, HitSearch
from kvtier.tiers.lower import LowerHits

pytestmark = pytest.mark.vllm

B = 16
MANAGERS = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
}


def spec(kind: str, size: int = 0):
    common = {"block_size": B, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    if kind == "window":
        return SlidingWindowSpec(**common, sliding_window=size)
    if kind == "chunk":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=size)
    return FullAttentionSpec(**common)


class HeldBlocks:
    """vLLM's block pool as its hit finders see it: which block of which group is cached."""

    hash_block_size = B
    null_block = object()

    def __init__(self, held: list[set[int]]):
        self.held = held

    def get_cached_block(self, block_hash: int, group_ids: list[int]):
        if all(block_hash in self.held[g] for g in group_ids):
            return [object() for _ in group_ids]
        return None


def vllm_hit(specs: list, held: list[set[int]], max_length: int, align: int) -> int:
    """vLLM's hybrid coordinator: every group in turn lowers the hit until none does."""
    pool = HeldBlocks(held)
    order = sorted(range(len(specs)), key=lambda g: not isinstance(specs[g], FullAttentionSpec))
    hashes = list(range(max_length // B + 1))
    hit = max_length
    while True:
        current = hit
        for g in order:
            _, current = MANAGERS[type(specs[g])].find_longest_cache_hit(
                block_hashes=hashes,
                max_length=current,
                kv_cache_group_ids=[g],
                block_pool=pool,
                kv_cache_spec=specs[g],
                drop_eagle_block=False,
                alignment_tokens=align,
            )
        if current >= hit:
            return hit
        hit = current


def kvtier_hit(specs: list, held: list[set[int]], start: int, end: int) -> tuple[int, int]:
    """kvtier's hit beyond ``start``, and the lookups it took, against a daemon holding
    ``held``."""
    groups = groups_from_kv_cache_config(
        SimpleNamespace(
            kv_cache_groups=[
                SimpleNamespace(layer_names=[f"l{g}"], kv_cache_spec=s) for g, s in enumerate(specs)
            ]
        )
    )
    asked = []

    def ask(chain, hashes, then):
        asked.append(len(hashes))
        n = 0
        while n < len(hashes) and hashes[n][0] in held[chain.group.index]:
            n += 1
        then(LowerHits(host=n))

    # Block i of group g is named by a hash whose first byte is i.
    chains = [
        Chain(group, [bytes([i, group.index]) * 8 for i in range(end // B)]) for group in groups
    ]
    search = HitSearch(chains, start, end, alignment_tokens(groups), ask)
    return search.result.result(timeout=10).tokens, len(asked)


MODELS = {
    "full": ["full"],
    "gpt-oss": ["window", "full"],
    "gemma-3": ["window"] * 5 + ["full"],
    "mistral": ["window"],
    "llama-4": ["chunk"] * 3 + ["full"],
    "two-windows": ["window", "window-small", "full"],
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_hit_is_vllms_for_random_held_blocks(model):
    rng = random.Random(model)
    for _ in range(400):
        window = rng.choice([17, 32, 48, 100, 128])
        specs = []
        for kind in MODELS[model]:
            if kind == "window-small":
                specs.append(spec("window", rng.choice([2, 16, 20])))
            else:
                specs.append(spec(kind, rng.choice([32, 64]) if kind == "chunk" else window))
        num_blocks = rng.randint(1, 40)
        density = rng.choice([0.3, 0.8, 0.95, 1.0])
        held = [{i for i in range(num_blocks) if rng.random() < density} for _ in specs]
        if rng.random() < 0.3:  # a window group that kept only what recent hits needed
            for g, s in enumerate(specs):
                if isinstance(s, SlidingWindowSpec):
                    held[g] -= set(range(rng.randint(0, num_blocks)))
        num_tokens = num_blocks * B + rng.randint(1, B)
        start = rng.randint(0, num_blocks // 2) * B
        # Below start lies vLLM's own GPU hit: every group holds what it needs there.
        reference_held = [h | set(range(start // B)) for h in held]
        want = vllm_hit(specs, reference_held, num_tokens - 1, B)
        end = (num_tokens - 1) // B * B
        got, _ = kvtier_hit(specs, held, start, end)
        assert start + got == max(want, start), (specs, sorted(map(sorted, held)), start)


def test_a_window_hole_behind_the_window_costs_one_more_lookup():
    # gpt-oss-like: the window group lacks blocks 0-9 (they slid out before it was stored),
    # holds 10-19; full attention holds 0-19. One round asks both groups from block 0; the
    # window group's answer stops at block 0, so a second round asks for its window alone.
    specs = [spec("window", 128), spec("full")]
    held = [set(range(10, 20)), set(range(20))]
    got, lookups = kvtier_hit(specs, held, 0, 20 * B)
    assert got == 20 * B
    assert lookups == 3
    assert vllm_hit(specs, held, 20 * B, B) == 20 * B
    # Without the window's last block the hit ends before it, where the window (blocks
    # 11-18) is whole again.
    held[0].discard(19)
    got, _ = kvtier_hit(specs, held, 0, 20 * B)
    assert got == vllm_hit(specs, held, 20 * B, B) == 19 * B
