"""The arms of a serving run: one engine and one GPU pool size, three depths of cache below it.

``engine-only`` is the engine's own prefix cache, the GPU pool alone; ``kvtier-host`` puts
kvtier's host tier behind the same pool; ``kvtier-host-disk`` adds the disk tier behind that.
Every arm serves the same requests at the same arrival times on a fresh stack. Unless given,
the tiers are sized from the requests' distinct full blocks, as the replay sizes them, but with
a GPU pool of 5% rather than 10%: a serving engine's pool also holds every request in flight,
and what it has left over for the prefix cache is what the lower tiers stand behind. The pool
always holds at least the largest request, or that request could never run.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.bench.serve.clock import Clock, WallClock
from kvtier.bench.serve.loop import LoopResult, Serving, ServingLoop
from kvtier.bench.serve.sample import ServeRequest
from kvtier.engine.config import ModelConfig
from kvtier.engine.engine import Engine
from kvtier.engine.model import Decoder
from kvtier.tiers.hashing import Namespace, hash_prompt
from kvtier.tiers.stack import TierStack, build_local_stack, build_stack

ARMS = ("engine-only", "kvtier-host", "kvtier-host-disk")
TITLES = {
    "engine-only": "engine prefix cache only",
    "kvtier-host": "+ kvtier host tier",
    "kvtier-host-disk": "+ kvtier host and disk",
}
GPU_SHARE = 0.05
HOST_SHARE = 0.30


@dataclass(frozen=True, slots=True)
class Sizes:
    """Tier capacities in blocks; every arm has ``gpu_blocks``."""

    gpu_blocks: int
    host_blocks: int
    disk_blocks: int


@dataclass(frozen=True, slots=True)
class ServeSetup:
    """What every arm shares: the model, its KV block, how the engine steps."""

    model: Decoder
    block_size: int
    chunk_blocks: int
    max_running: int
    step_tokens: int
    clock: type[Clock] = WallClock
    disk_dir: str | None = None
    """Parent directory of the disk tier (default: the system's temporary directory)."""

    @property
    def config(self) -> ModelConfig:
        return self.model.config


@dataclass(slots=True)
class ArmResult:
    """One arm's run, its tiers' spill counts and (vLLM) its hits."""

    name: str
    loop: LoopResult
    blocks_spilled_to_host: int = 0
    blocks_spilled_to_disk: int = 0
    hit_tokens: dict[str, int] | None = None
    """Hit tokens per tier for the whole arm, where the engine counts them per run rather
    than per request (vLLM); otherwise the requests' outcomes are summed."""


COUNTING_NAMESPACE = Namespace("kvtier-bench-serve", b"")
"""Counting distinct blocks needs only that equal prefixes hash alike, in any namespace."""


def distinct_blocks(block_size: int, requests: Sequence[ServeRequest]) -> int:
    """Distinct full blocks of ``block_size`` tokens among the requests' prompts."""
    seen: set[bytes] = set()
    for request in requests:
        seen.update(hash_prompt(COUNTING_NAMESPACE, request.prompt, block_size))
    return len(seen)


def reusable_tokens(
    block_size: int,
    chunk_blocks: int,
    requests: Sequence[ServeRequest],
    arrivals_s: Sequence[float],
) -> int:
    """Prompt tokens an unbounded cache could supply: each request's longest prefix of blocks
    that an earlier arrival's prompt holds, cut to whole chunks of ``chunk_blocks`` and short
    of the last token, as the engine takes a prefix. The most any arm can hit."""
    bs, chunk = block_size, chunk_blocks
    seen: set[bytes] = set()
    total = 0
    for i in sorted(range(len(requests)), key=lambda i: arrivals_s[i]):
        prompt = requests[i].prompt
        hashes = hash_prompt(COUNTING_NAMESPACE, prompt, bs)
        usable = min(len(hashes), (len(prompt) - 1) // bs)
        hit = next((k for k in range(usable) if hashes[k] not in seen), usable)
        total += hit // chunk * chunk * bs
        seen.update(hashes)
    return total


def size_tiers(
    block_size: int,
    requests: Sequence[ServeRequest],
    gpu_blocks: int | None = None,
    host_blocks: int | None = None,
    disk_blocks: int | None = None,
) -> Sizes:
    """The given sizes, each missing one sized from the requests."""
    distinct = max(distinct_blocks(block_size, requests), 1)
    if gpu_blocks is None:
        bs = block_size
        largest = max(-(-(len(r.prompt) + r.output_tokens) // bs) for r in requests)
        gpu_blocks = max(math.ceil(GPU_SHARE * distinct), largest)
    if host_blocks is None:
        host_blocks = math.ceil(HOST_SHARE * distinct)
    if disk_blocks is None:
        disk_blocks = distinct
    return Sizes(gpu_blocks, host_blocks, disk_blocks)


def build_arm_stack(name: str, setup: ServeSetup, sizes: Sizes, disk_path: str) -> TierStack:
    layout = setup.config.kv_layout(setup.block_size)
    device = setup.model.device
    if name == "engine-only":
        return build_stack(layout, sizes.gpu_blocks, device=device)
    host_bytes = sizes.host_blocks * layout.block_bytes
    if name == "kvtier-host":
        return build_local_stack(layout, sizes.gpu_blocks, host_bytes=host_bytes, device=device)
    if name == "kvtier-host-disk":
        return build_local_stack(
            layout,
            sizes.gpu_blocks,
            host_bytes=host_bytes,
            disk_path=disk_path,
            disk_bytes=sizes.disk_blocks * layout.block_bytes,
            device=device,
        )
    raise ValueError(f"unknown arm {name!r}; arms are {', '.join(ARMS)}")


def run_arms(
    names: Sequence[str],
    setup: ServeSetup,
    sizes: Sizes,
    requests: Sequence[ServeRequest],
    arrivals_s: Sequence[float],
) -> list[ArmResult]:
    """Serves the requests through a fresh stack of each named arm; closes them after.

    On a clock whose runs take turns (the engine clock) the arms advance a step at a time, the
    one furthest behind first, so whatever else loads the machine falls on every arm alike;
    on the wall clock they run one after another.
    """
    with contextlib.ExitStack() as exits:
        loops: list[ServingLoop] = []
        stacks: list[TierStack] = []
        for name in names:
            tmp = exits.enter_context(
                tempfile.TemporaryDirectory(prefix="kvtier-serve-", dir=setup.disk_dir)
            )
            stack = build_arm_stack(name, setup, sizes, tmp)
            exits.callback(stack.close, persist=False)
            stacks.append(stack)
            engine = Engine(setup.model, stack, chunk_blocks=setup.chunk_blocks)
            loops.append(
                ServingLoop(
                    engine,
                    max_running=setup.max_running,
                    step_tokens=setup.step_tokens,
                    clock=setup.clock,
                )
            )
        if setup.clock.takes_turns:
            runs = [loop.start(requests, arrivals_s) for loop in loops]
            while not all(run.done for run in runs):
                min((run for run in runs if not run.done), key=Serving.now).advance()
            results = [run.result() for run in runs]
        else:
            results = [loop.run(requests, arrivals_s) for loop in loops]
        return [
            _arm_result(name, stack, result)
            for name, stack, result in zip(names, stacks, results, strict=True)
        ]


def _arm_result(name: str, stack: TierStack, loop: LoopResult) -> ArmResult:
    if stack.engine is not None:
        stack.engine.synchronize()
    result = ArmResult(name, loop, blocks_spilled_to_host=stack.pool.counters.blocks_spilled)
    if stack.lower is not None:
        result.blocks_spilled_to_disk = stack.lower.counters.blocks_spilled
    return result


def engine_capacity(setup: ServeSetup, sizes: Sizes, requests: Sequence[ServeRequest]) -> float:
    """Prompt tokens per busy second of the engine-only arm, all of ``requests`` offered at
    once (the engine always has work, as at saturation)."""
    (result,) = run_arms(["engine-only"], setup, sizes, requests, [0.0] * len(requests))
    prompt = sum(len(r.prompt) for r in requests)
    return prompt / max(result.loop.busy_s, 1e-9)
