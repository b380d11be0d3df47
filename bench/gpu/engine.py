"""The reference engine on a CUDA device, for ``kvtier bench gpu``: TTFT and zero-reuse cost.

Time to first token of one long prompt is measured three ways on the same model: computed
from scratch, with its prefix loaded from the host tier (its GPU blocks were recycled by a
filler prompt and spilled), and with its prefix loaded from the disk tier (a second filler
pushed it out of the host tier, then the stack was closed and reopened on the same directory;
the OS page cache may still hold the file, so this is a warm-disk figure). The zero-reuse cost
runs unique prompts with greedy decode, kvtier's lower tiers on and off, and compares the mean
step time (prefill or decode) of the two.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass

import torch

from kvtier.engine.config import ModelConfig
from kvtier.engine.engine import Engine, SequenceState
from kvtier.engine.model import Decoder
from kvtier.tiers.stack import TierStack, build_local_stack, build_stack

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class TtftResult:
    prompt_tokens: int
    recompute_ms: float
    host_ms: float
    disk_ms: float
    host_hit_blocks: int
    disk_hit_blocks: int
    logits_equal: bool


@dataclass(frozen=True, slots=True)
class OverheadResult:
    step_ms_off: float
    step_ms_on: float
    steps: int

    @property
    def overhead(self) -> float:
        return self.step_ms_on / self.step_ms_off - 1.0


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def _timed_prefill(engine: Engine, prompt: list[int]) -> tuple[SequenceState, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    seq = engine.prefill(prompt)
    seq.last_logits.cpu()  # the first token exists once its logits reach the host
    elapsed = (time.perf_counter() - start) * 1000
    engine.finish(seq)
    return seq, elapsed


def _run(engine: Engine, prompt: list[int]) -> None:
    engine.finish(engine.prefill(prompt))


def measure_ttft(
    config: ModelConfig, model: Decoder, prompt_tokens: int, chunk_blocks: int
) -> TtftResult:
    """TTFT of one prompt recomputed, from the host tier and from the disk tier."""
    layout = config.kv_layout(BLOCK_SIZE)
    blocks = -(-prompt_tokens // BLOCK_SIZE)
    prompt = _prompt(1, prompt_tokens, config.vocab_size)
    fillers = [_prompt(10 + i, prompt_tokens, config.vocab_size) for i in range(3)]

    def local(disk_dir: str | None, host_blocks: int) -> TierStack:
        # A pool of exactly one prompt: each filler recycles every block of the one before.
        return build_local_stack(
            layout,
            blocks,
            host_bytes=host_blocks * layout.block_bytes,
            disk_path=disk_dir,
            disk_bytes=8 * blocks * layout.block_bytes,
            device="cuda",
        )

    stack = local(None, 3 * blocks)
    engine = Engine(model, stack, chunk_blocks=chunk_blocks)
    _run(engine, fillers[2])  # warm-up: kernels, allocator, cuBLAS handles
    cold, recompute_ms = _timed_prefill(engine, prompt)
    _run(engine, fillers[0])
    stack.engine.synchronize()  # the spills are committed (readable) before the reuse
    host, host_ms = _timed_prefill(engine, prompt)
    stack.close()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-gpu-") as tmp:
        stack = local(tmp, blocks)
        engine = Engine(model, stack, chunk_blocks=chunk_blocks)
        for p in (prompt, fillers[0], fillers[1]):  # prompt -> host -> disk
            _run(engine, p)
            stack.engine.synchronize()  # commit the spills before the next one needs room
        stack.close()
        stack = local(tmp, blocks)
        try:
            disk, disk_ms = _timed_prefill(Engine(model, stack, chunk_blocks=chunk_blocks), prompt)
        finally:
            stack.close()
    equal = torch.equal(cold.last_logits, host.last_logits) and torch.equal(
        cold.last_logits, disk.last_logits
    )
    return TtftResult(
        prompt_tokens,
        recompute_ms,
        host_ms,
        disk_ms,
        host.host_hit_blocks,
        disk.disk_hit_blocks,
        equal,
    )


def _mean_step_ms(engine: Engine, prompts: list[list[int]], decode_steps: int) -> tuple[float, int]:
    steps = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    for prompt in prompts:
        seq = engine.prefill(prompt)
        for _ in range(decode_steps):
            engine.decode(seq)
        engine.finish(seq)
        steps += 1 + decode_steps
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / steps, steps


def measure_zero_reuse(
    config: ModelConfig,
    model: Decoder,
    prompt_tokens: int,
    requests: int,
    decode_steps: int,
    chunk_blocks: int,
) -> OverheadResult:
    """Mean step time over unique prompts with the lower tiers off, then on (spilling)."""
    layout = config.kv_layout(BLOCK_SIZE)
    per_request = -(-(prompt_tokens + decode_steps) // BLOCK_SIZE)
    gpu_blocks = 2 * per_request  # small enough that every request recycles cached blocks
    prompts = [_prompt(100 + i, prompt_tokens, config.vocab_size) for i in range(requests)]
    warm = [_prompt(99, prompt_tokens, config.vocab_size)]
    off = Engine(model, build_stack(layout, gpu_blocks, device="cuda"), chunk_blocks=chunk_blocks)
    _mean_step_ms(off, warm, decode_steps)
    step_off, steps = _mean_step_ms(off, prompts, decode_steps)
    stack = build_local_stack(
        layout,
        gpu_blocks,
        host_bytes=(requests + 2) * per_request * layout.block_bytes,
        device="cuda",
    )
    try:
        on = Engine(model, stack, chunk_blocks=chunk_blocks)
        _mean_step_ms(on, warm, decode_steps)
        step_on, _ = _mean_step_ms(on, prompts, decode_steps)
    finally:
        stack.close()
    return OverheadResult(step_off, step_on, steps)
