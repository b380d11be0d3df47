"""Blocks pushed GPU → host → disk by pressure come back bit-exact, even after a reopen."""

from __future__ import annotations

import random

import torch

from kvtier.tiers.hashing import ExtraKeys, Namespace, hash_prompt
from kvtier.tiers.layout import KVLayout
from kvtier.tiers.stack import build_local_stack

from tierutil import block_content, run_request

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype=torch.float16)
NS = Namespace("tiny", LAYOUT.signature)


def prompts(count: int, blocks: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32000) for _ in range(blocks * 4)] for _ in range(count)]


def flip_stored_byte(directory, payload: bytes) -> None:
    """Flips one bit in the middle of ``payload`` wherever the disk tier keeps it on disk."""
    for path in directory.iterdir():
        data = bytearray(path.read_bytes())
        at = data.find(payload)
        if at >= 0:
            data[at + len(payload) // 2] ^= 0x20
            path.write_bytes(bytes(data))
            return
    raise AssertionError("the block's bytes are in no file of the disk tier")


def stack_on(path, gpu_blocks=6, host_blocks=8):
    return build_local_stack(
        LAYOUT,
        gpu_blocks,
        host_bytes=host_blocks * LAYOUT.block_bytes,
        disk_path=path,
        disk_bytes=1000 * LAYOUT.block_bytes,
    )


def test_pressure_close_reopen_walk_back(tmp_path):
    requests = [hash_prompt(NS, p, 4) for p in prompts(12, 3, seed=1)]
    stack = stack_on(tmp_path)
    for hashes in requests:
        assert run_request(stack, hashes) == (0, 0, 0)
    # the newest blocks are still on the GPU; the oldest went down to the disk
    assert run_request(stack, requests[-1]) == (3, 0, 0)
    assert stack.pool.counters.blocks_spilled >= 30
    assert stack.lower.counters.blocks_spilled > 0  # host pressure pushed blocks to disk
    stack.close()
    assert len(stack.disk) == 12 * 3  # a graceful close persisted GPU and host blocks

    stack = stack_on(tmp_path)
    try:
        for hashes in requests:
            gpu, host, disk = run_request(stack, hashes)
            assert (gpu, host) == (0, 0)
            assert disk == 3
        assert stack.cache.counters.disk.hit_tokens == 12 * 3 * 4
    finally:
        stack.close()


def test_host_hits_come_back_exact(tmp_path):
    requests = [hash_prompt(NS, p, 4) for p in prompts(3, 3, seed=2)]
    stack = stack_on(tmp_path, gpu_blocks=3, host_blocks=20)
    try:
        for hashes in requests:
            run_request(stack, hashes)
        assert run_request(stack, requests[0]) == (0, 3, 0)
        assert stack.cache.counters.host.hit_tokens == 12
    finally:
        stack.close()


def test_flipped_byte_on_disk_is_a_miss(tmp_path):
    hashes = hash_prompt(NS, prompts(1, 3, seed=3)[0], 4)
    stack = stack_on(tmp_path, gpu_blocks=3, host_blocks=4)
    run_request(stack, hashes)
    stack.close()

    flip_stored_byte(tmp_path, block_content(hashes[1], LAYOUT.block_bytes).numpy().tobytes())

    stack = stack_on(tmp_path, gpu_blocks=3, host_blocks=4)
    try:
        gpu, host, disk = run_request(stack, hashes)
        assert (gpu, host, disk) == (
            0,
            0,
            1,
        )  # block 0 loads, block 1 fails its checksum, the walk stops
        assert stack.disk.counters.checksum_failures == 1
    finally:
        stack.close()


def test_other_salt_or_layout_misses(tmp_path):
    tokens = prompts(1, 3, seed=5)[0]
    stack = stack_on(tmp_path, gpu_blocks=3, host_blocks=4)
    try:
        run_request(stack, hash_prompt(NS, tokens, 4))
        assert stack.cache.match(hash_prompt(NS, tokens, 4), 13).num_blocks == 3
        salted = hash_prompt(NS, tokens, 4, ExtraKeys(cache_salt="tenant-b"))
        assert stack.cache.match(salted, 13).num_blocks == 0
        other = KVLayout(2, 2, 8, 4, torch.bfloat16)
        assert (
            stack.cache.match(
                hash_prompt(Namespace("tiny", other.signature), tokens, 4), 13
            ).num_blocks
            == 0
        )
    finally:
        stack.close()


def test_last_prompt_token_is_never_claimed(tmp_path):
    hashes = hash_prompt(NS, prompts(1, 3, seed=6)[0], 4)
    stack = stack_on(tmp_path)
    try:
        run_request(stack, hashes)
        assert stack.cache.match(hashes, 12).num_blocks == 2  # 12 tokens: block 3 holds the last
        assert stack.cache.match(hashes, 13).num_blocks == 3
    finally:
        stack.close()
