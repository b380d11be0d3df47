"""Helpers for tests that drive a tier stack like an engine would."""

from __future__ import annotations

import torch

from kvtier.tiers.free_queue import KVBlock
from kvtier.tiers.stack import TierStack


def block_content(block_hash: bytes, block_bytes: int) -> torch.Tensor:
    """Deterministic bytes for the block named ``block_hash`` (what "compute" writes)."""
    gen = torch.Generator().manual_seed(int.from_bytes(block_hash[:8], "little"))
    return torch.randint(0, 256, (block_bytes,), dtype=torch.uint8, generator=gen)


def read_blocks(stack: TierStack, blocks: list[KVBlock]) -> torch.Tensor:
    ids = torch.tensor([b.block_id for b in blocks], dtype=torch.long)
    out = torch.empty((len(blocks), stack.layout.block_bytes), dtype=torch.uint8)
    stack.placement.gather(ids, out)
    return out


def compute_blocks(stack: TierStack, blocks: list[KVBlock], hashes: list[bytes]) -> None:
    """Writes each block's content as a forward pass would, then names it by its hash."""
    if not blocks:
        return
    for transfer in stack.pool.pending_reads(blocks):
        transfer.wait()
    ids = torch.tensor([b.block_id for b in blocks], dtype=torch.long)
    src = torch.stack([block_content(h, stack.layout.block_bytes) for h in hashes])
    stack.placement.scatter(src, ids)
    stack.pool.cache_full_blocks(blocks, hashes)


def run_request(stack: TierStack, hashes: list[bytes]) -> tuple[int, int, int]:
    """Serves one prompt of ``len(hashes)`` full blocks plus one token; checks loaded bytes.

    Returns (gpu, host, disk) hits in blocks.
    """
    bs = stack.layout.block_size
    match = stack.cache.match(hashes, len(hashes) * bs + 1)
    claimed = stack.cache.claim(match)
    claimed.wait()
    n = len(claimed.blocks)
    if n:
        want = torch.stack([block_content(h, stack.layout.block_bytes) for h in hashes[:n]])
        got = read_blocks(stack, claimed.blocks)
        assert torch.equal(got, want), "a block came back with other bytes"
    new = stack.pool.get_new_blocks(len(hashes) - n)
    compute_blocks(stack, new, hashes[n:])
    stack.pool.free_blocks(reversed(claimed.blocks + new))
    return claimed.gpu_hits, claimed.host_hits, claimed.disk_hits
