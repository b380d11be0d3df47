"""The serving loop: requests arrive on a clock and share each step of one engine.

Continuous batching as vLLM's scheduler does it, kept small. A request is admitted once it has
arrived, fewer than ``max_running`` requests run and the pool can hold its whole sequence beside
what the running ones will still need (so no request is ever preempted); admission takes its
cached prefix from whichever tier holds it. Each step then computes one token of every decoding
request in one batched forward pass (always ``max_running`` rows high, so a request's tokens do
not depend on its neighbours) and spends the rest of its token budget on prefill chunks, oldest
request first. A request's first token exists when its last prefill chunk is done: its time to
first token runs from its arrival to the end of that step. Time is the ``clock``'s: real time,
or the engine's own (``clock``). ``ServingLoop.start`` gives a run that advances one step at a
time, so that runs on engine clocks can take turns on one thread.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.bench.serve.clock import Clock, WallClock
from kvtier.bench.serve.sample import ServeRequest
from kvtier.engine.engine import Engine, SequenceState


@dataclass(slots=True)
class Outcome:
    """What one request got: its times (seconds from the run's start), prefix and tokens."""

    arrival_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    output_tokens: int
    gpu_hit_tokens: int
    host_hit_tokens: int
    disk_hit_tokens: int
    tokens: list[int]
    first_logits: str
    """A digest of the logits after the prompt: equal only if they are equal bit for bit."""

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens this request prefilled (those no tier supplied)."""
        hits = self.gpu_hit_tokens + self.host_hit_tokens + self.disk_hit_tokens
        return self.prompt_tokens - hits


@dataclass(slots=True)
class LoopResult:
    """Every request's outcome (in the order given) and where the engine's time went."""

    outcomes: list[Outcome]
    busy_s: float
    """Time spent in steps: the sum of the three parts below and of finishing requests."""
    admit_s: float | None
    """Admissions: hashing, the walk, lower-tier loads (None where the engine hides it)."""
    decode_s: float | None
    """Batched decode forward passes (None where the engine hides it)."""
    prefill_s: float | None
    """Prefill chunks (None where the engine hides it)."""
    span_s: float
    """From the first arrival to the last request's end."""
    steps: int
    max_running: int


@dataclass(slots=True)
class _Active:
    index: int
    request: ServeRequest
    seq: SequenceState
    total_blocks: int
    prefilled: bool = False
    first_token_s: float = 0.0
    first_logits: str = ""
    tokens: list[int] = field(default_factory=list)

    @property
    def remaining_tokens(self) -> int:
        """Output tokens still to come; the last one is read off the logits without a step."""
        return self.request.output_tokens - len(self.tokens)


class ServingLoop:
    """Serves requests through ``engine`` with up to ``max_running`` of them in flight."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_running: int,
        step_tokens: int,
        clock: Callable[[], Clock] = WallClock,
    ):
        if max_running < 1:
            raise ValueError(f"max_running must be positive, got {max_running}")
        if step_tokens <= max_running:
            raise ValueError(
                f"a step of {step_tokens} tokens leaves no room for prefill beside "
                f"{max_running} decoding requests"
            )
        self.engine = engine
        self.max_running = max_running
        self.step_tokens = step_tokens
        self.clock = clock

    def blocks_needed(self, request: ServeRequest) -> int:
        """GPU blocks the request holds at its end: the prompt and every token but the last
        (the last one is read off the logits, never fed back)."""
        tokens = len(request.prompt) + request.output_tokens - 1
        return -(-tokens // self.engine.block_size)

    def run(self, requests: Sequence[ServeRequest], arrivals_s: Sequence[float]) -> LoopResult:
        """Serves ``requests``, request ``i`` arriving ``arrivals_s[i]`` seconds after the start."""
        serving = self.start(requests, arrivals_s)
        while not serving.done:
            serving.advance()
        return serving.result()

    def start(self, requests: Sequence[ServeRequest], arrivals_s: Sequence[float]) -> Serving:
        """A run of ``requests`` that ``Serving.advance`` moves on; its clock starts now."""
        if len(requests) != len(arrivals_s):
            raise ValueError(f"{len(requests)} requests but {len(arrivals_s)} arrival times")
        pool_blocks = len(self.engine.stack.pool.blocks)
        for request in requests:
            if self.blocks_needed(request) > pool_blocks:
                raise ValueError(
                    f"a request of {len(request.prompt)} + {request.output_tokens} tokens "
                    f"needs {self.blocks_needed(request)} blocks, the pool has {pool_blocks}"
                )
        return Serving(self, requests, arrivals_s)


class Serving:
    """One run of a ``ServingLoop``: its requests' state and its clock."""

    def __init__(
        self, loop: ServingLoop, requests: Sequence[ServeRequest], arrivals_s: Sequence[float]
    ):
        self.loop = loop
        self.engine = loop.engine
        self.requests = requests
        self.arrivals_s = arrivals_s
        self.pending = deque(sorted(range(len(requests)), key=lambda i: arrivals_s[i]))
        self.waiting: deque[int] = deque()
        self.active: list[_Active] = []
        self.outcomes: list[Outcome | None] = [None] * len(requests)
        self.times = dict.fromkeys(("busy", "admit", "decode", "prefill"), 0.0)
        self.steps = 0
        self.max_running = 0
        self.clock = loop.clock()

    @property
    def done(self) -> bool:
        return not (self.pending or self.waiting or self.active)

    def now(self) -> float:
        return self.clock.now()

    def advance(self) -> None:
        """Takes in the arrivals, then runs one step, or waits for the next arrival if idle."""
        clock = self.clock
        while self.pending and self.arrivals_s[self.pending[0]] <= clock.now():
            self.waiting.append(self.pending.popleft())
        if not self.active and not self.waiting:
            clock.wait_until(self.arrivals_s[self.pending[0]])
            return
        start = clock.now()
        mark = clock.mark()
        self._admit()
        self.times["admit"] += clock.lap(mark, waits=True)
        self.max_running = max(self.max_running, len(self.active))
        first_tokens, finished = self._step()
        end = clock.now()
        self.times["busy"] += end - start
        self.steps += 1
        for a in first_tokens:
            a.first_token_s = end
            a.first_logits = _digest(a.seq.last_logits)
        for a in finished:
            self.outcomes[a.index] = self._outcome(a, end)

    def result(self) -> LoopResult:
        done = [o for o in self.outcomes if o is not None]
        assert len(done) == len(self.requests), "every request ends before the run does"
        first = min(self.arrivals_s, default=0.0)
        span = max((o.finish_s for o in done), default=first) - first
        t = self.times
        return LoopResult(
            done,
            t["busy"],
            t["admit"],
            t["decode"],
            t["prefill"],
            span,
            self.steps,
            self.max_running,
        )

    def _admit(self) -> None:
        """Admits waiting requests in arrival order while there is room for the next one."""
        while self.waiting and len(self.active) < self.loop.max_running:
            index = self.waiting[0]
            request = self.requests[index]
            need = self.loop.blocks_needed(request)
            if self._free_blocks() < need:
                break
            self.waiting.popleft()
            seq = self.engine.begin(request.prompt)
            self.active.append(_Active(index, request, seq, need))

    def _free_blocks(self) -> int:
        """Free blocks less those the running requests will still take."""
        reserved = sum(a.total_blocks - len(a.seq.blocks) for a in self.active)
        return self.engine.stack.pool.num_free - reserved

    def _step(self) -> tuple[list[_Active], list[_Active]]:
        """One engine step; returns the requests whose prefill it finished and those it
        finished (which it takes out of ``active``)."""
        clock, times, active = self.clock, self.times, self.active
        mark = clock.mark()
        decoding = [a for a in active if a.prefilled]
        if decoding:
            seqs = [a.seq for a in decoding]
            tokens = self.engine.decode_batch(seqs, rows=self.loop.max_running)
            for a, token in zip(decoding, tokens, strict=True):
                a.tokens.append(token)
            self._sync()
        times["decode"] += clock.lap(mark, waits=False)
        mark = clock.mark()
        budget = self.loop.step_tokens - len(decoding)
        first_tokens: list[_Active] = []
        for a in active:
            if budget <= 0:
                break
            while budget > 0 and not a.prefilled:
                before = a.seq.num_computed
                a.prefilled = self.engine.prefill_chunk(a.seq)
                budget -= a.seq.num_computed - before
                if a.prefilled:
                    first_tokens.append(a)
        self._sync()
        times["prefill"] += clock.lap(mark, waits=False)
        mark = clock.mark()
        finished = [a for a in active if a.prefilled and a.remaining_tokens <= 1]
        for a in finished:
            active.remove(a)
            a.tokens.append(int(torch.argmax(a.seq.last_logits)))
            self.engine.finish(a.seq)
        clock.lap(mark, waits=False)
        return first_tokens, finished

    def _sync(self) -> None:
        """A part of a step ends when its kernels have, not when they are queued."""
        if self.engine.model.device.type == "cuda":
            torch.cuda.synchronize()

    def _outcome(self, a: _Active, finish_s: float) -> Outcome:
        bs, seq = self.engine.block_size, a.seq
        return Outcome(
            self.arrivals_s[a.index],
            a.first_token_s,
            finish_s,
            len(a.request.prompt),
            a.request.output_tokens,
            seq.gpu_hit_blocks * bs,
            seq.host_hit_blocks * bs,
            seq.disk_hit_blocks * bs,
            a.tokens,
            a.first_logits,
        )


def _digest(logits: torch.Tensor) -> str:
    return hashlib.blake2b(logits.float().cpu().numpy().tobytes(), digest_size=16).hexdigest()
