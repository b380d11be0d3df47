"""Next-token logits are bit-identical whether the prefix KV was recomputed or came from a tier.

Prompt ``A`` and prompt ``B`` share a five-block prefix. ``B``'s logits on a cold engine are the
reference; then ``A`` runs first and ``B`` takes the prefix from the GPU pool, from the host
tier after ``A``'s blocks were spilled, from the disk tier after the host tier spilled them
and the stack was closed and reopened on the same directory, or from a ``kvtier serve`` daemon
through ``DaemonClient``: from its host tier, then from its disk tier after a restart.

Every test runs for a Llama-style model and for a hybrid one whose sliding-window layers (a
window of two blocks, shorter than the prefix) alternate with full-attention layers.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.engine.config import ModelConfig
from kvtier.engine.engine import Engine, SequenceState
from kvtier.engine.model import Decoder
from kvtier.tiers.stack import TierStack, build_local_stack, build_stack

from daemonutil import Daemon

BLOCK = 16
GPU_BLOCKS = 8
PREFIX_BLOCKS = 5
CONFIGS = {"llama": ModelConfig.tiny(), "hybrid": ModelConfig.hybrid(sliding_window=2 * BLOCK)}
VOCAB = ModelConfig.tiny().vocab_size


def tokens(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


PREFIX = tokens(1, PREFIX_BLOCKS * BLOCK)
PROMPT_A = PREFIX + tokens(2, 20)
PROMPT_B = PREFIX + tokens(3, 9)
FILLERS = [tokens(10 + i, GPU_BLOCKS * BLOCK) for i in range(2)]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request: pytest.FixtureRequest) -> Decoder:
    return Decoder(CONFIGS[request.param])


def layout(model: Decoder):
    return model.config.kv_layout(BLOCK)


def run(engine: Engine, prompt: list[int]) -> SequenceState:
    seq = engine.prefill(prompt)
    engine.finish(seq)
    return seq


def host_stack(model: Decoder, host_blocks: int, disk_path=None) -> TierStack:
    kv = layout(model)
    return build_local_stack(
        kv,
        GPU_BLOCKS,
        host_bytes=host_blocks * kv.block_bytes,
        disk_path=disk_path,
        disk_bytes=64 * kv.block_bytes,
    )


@pytest.fixture(scope="module", params=[1, 2], ids=["chunk1", "chunk2"])
def chunk_blocks(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture(scope="module")
def reference(model: Decoder, chunk_blocks: int) -> torch.Tensor:
    engine = Engine(model, build_stack(layout(model), GPU_BLOCKS), chunk_blocks=chunk_blocks)
    seq = run(engine, PROMPT_B)
    assert seq.cached_tokens == 0
    return seq.last_logits


def expected_blocks(chunk_blocks: int) -> int:
    return PREFIX_BLOCKS // chunk_blocks * chunk_blocks


def test_sliding_window_changes_the_logits(model: Decoder, chunk_blocks: int, reference):
    """The hybrid model's windows reach back less far than the prefix: were they ignored
    (every layer full attention), the logits would differ, so the tests below can fail."""
    config = model.config
    if config.sliding_window is None:
        pytest.skip("no sliding-window layers")
    assert config.sliding_window < PREFIX_BLOCKS * BLOCK
    full = Decoder(replace(config, sliding_window=None, sliding_layers=()))
    engine = Engine(full, build_stack(layout(full), GPU_BLOCKS), chunk_blocks=chunk_blocks)
    assert not torch.equal(run(engine, PROMPT_B).last_logits, reference)


def test_recompute_is_deterministic(model: Decoder, chunk_blocks: int, reference: torch.Tensor):
    engine = Engine(model, build_stack(layout(model), GPU_BLOCKS), chunk_blocks=chunk_blocks)
    assert torch.equal(run(engine, PROMPT_B).last_logits, reference)


def test_gpu_hit(model: Decoder, chunk_blocks: int, reference: torch.Tensor):
    engine = Engine(model, build_stack(layout(model), GPU_BLOCKS), chunk_blocks=chunk_blocks)
    run(engine, PROMPT_A)
    seq = run(engine, PROMPT_B)
    assert seq.gpu_hit_blocks == expected_blocks(chunk_blocks)
    assert seq.cached_tokens == expected_blocks(chunk_blocks) * BLOCK
    assert torch.equal(seq.last_logits, reference)


def test_host_hit(model: Decoder, chunk_blocks: int, reference: torch.Tensor):
    stack = host_stack(model, 4 * GPU_BLOCKS)  # room for A and the filler's spill-ahead
    engine = Engine(model, stack, chunk_blocks=chunk_blocks)
    run(engine, PROMPT_A)
    run(engine, FILLERS[0])  # recycles every GPU block: A's blocks spill to the host tier
    seq = run(engine, PROMPT_B)
    stack.close()
    assert (seq.gpu_hit_blocks, seq.host_hit_blocks, seq.disk_hit_blocks) == (
        0,
        expected_blocks(chunk_blocks),
        0,
    )
    assert torch.equal(seq.last_logits, reference)


def test_disk_hit_after_reopen(model, chunk_blocks: int, reference: torch.Tensor, tmp_path):
    stack = host_stack(model, GPU_BLOCKS, tmp_path)
    engine = Engine(model, stack, chunk_blocks=chunk_blocks)
    run(engine, PROMPT_A)
    for filler in FILLERS:  # A's blocks: GPU -> host, then host -> disk
        run(engine, filler)
    stack.close()
    stack = host_stack(model, GPU_BLOCKS, tmp_path)
    try:
        seq = run(Engine(model, stack, chunk_blocks=chunk_blocks), PROMPT_B)
    finally:
        stack.close()
    assert (seq.gpu_hit_blocks, seq.host_hit_blocks, seq.disk_hit_blocks) == (
        0,
        0,
        expected_blocks(chunk_blocks),
    )
    assert torch.equal(seq.last_logits, reference)


def test_daemon_hit_and_after_daemon_restart(model, chunk_blocks: int, reference: torch.Tensor):
    kv = layout(model)
    daemon = Daemon(host_bytes=64 * kv.block_bytes, disk_bytes=256 * kv.block_bytes)
    daemon.start()
    client = DaemonClient(kv.signature, kv.block_bytes, block_tokens=BLOCK, target=daemon.target)
    try:
        assert client.wait_connected(60), daemon.log.read_text()
        stack = build_stack(kv, GPU_BLOCKS, lower=client)
        engine = Engine(model, stack, chunk_blocks=chunk_blocks)
        run(engine, PROMPT_A)
        run(engine, FILLERS[0])  # A's blocks spill into the daemon's host tier
        from_host = run(engine, PROMPT_B)
        # A restart empties the daemon's host tier; its disk tier still holds A's blocks.
        assert daemon.stop() == 0
        daemon.proc = None
        daemon.start()
        assert client.wait_connected(60), daemon.log.read_text()
        run(engine, FILLERS[1])  # recycles B's GPU blocks so the prefix is no GPU hit
        from_disk = run(engine, PROMPT_B)
        stack.close()
    finally:
        client.close()
        daemon.cleanup()
    n = expected_blocks(chunk_blocks)
    assert (from_host.gpu_hit_blocks, from_host.host_hit_blocks) == (0, n)
    assert from_disk.gpu_hit_blocks == 0
    assert (from_disk.host_hit_blocks, from_disk.disk_hit_blocks) == (0, n)
    assert torch.equal(from_host.last_logits, reference)
    assert torch.equal(from_disk.last_logits, reference)
