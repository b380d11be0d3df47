"""The requests a serving run offers: whole conversations sampled from a trace, in tokens.

Most of a trace's requests start with one prefix (a system prompt, tool definitions); a
conversation is the requests that agree on the block after it. Any two requests that share more
than that prefix are in one conversation, so sampling whole conversations keeps every reuse
among the sampled requests but that of the common prefix itself, which they all still share.
Arrival times are kept as they are, for the serving run to scale. Each 512-token trace block
becomes ``block_tokens`` tokens of the model's vocabulary, drawn from the block's id as the
replay does, so two prompts share a prefix exactly as far as their blocks agree.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.bench.replay.trace import TRACE_BLOCK_TOKENS, TraceRequest, block_tokens


@dataclass(frozen=True, slots=True)
class ServeRequest:
    """One request of a serving run: when it arrives (trace seconds), its prompt, its output."""

    arrival_s: float
    prompt: tuple[int, ...]
    output_tokens: int


def common_prefix(requests: Sequence[TraceRequest]) -> tuple[int, ...]:
    """The longest run of leading block ids that more than half of the requests start with."""
    prefix: tuple[int, ...] = ()
    while True:
        depth = len(prefix)
        nexts = Counter(
            r.hash_ids[depth]
            for r in requests
            if len(r.hash_ids) > depth and r.hash_ids[:depth] == prefix
        )
        if not nexts:
            return prefix
        block_id, count = nexts.most_common(1)[0]
        if 2 * count <= len(requests):
            return prefix
        prefix = (*prefix, block_id)


def conversations(requests: Sequence[TraceRequest]) -> list[list[int]]:
    """Indices of ``requests`` (in arrival order) grouped by conversation."""
    depth = len(common_prefix(requests)) + 1
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, request in enumerate(requests):
        groups.setdefault(request.hash_ids[:depth], []).append(index)
    return list(groups.values())


def sample_conversations(
    requests: Sequence[TraceRequest], max_requests: int, seed: int
) -> list[TraceRequest]:
    """Whole conversations drawn at random until ``max_requests``, in arrival order."""
    groups = conversations(requests)
    random.Random(seed).shuffle(groups)
    picked: list[int] = []
    for group in groups:
        if len(picked) + len(group) > max_requests:
            continue
        picked.extend(group)
        if len(picked) == max_requests:
            break
    return [requests[i] for i in sorted(picked)]


def to_serve_requests(
    requests: Sequence[TraceRequest], block_tokens_: int, vocab_size: int
) -> list[ServeRequest]:
    """Each trace block shrunk to ``block_tokens_`` tokens; lengths shrink by the same factor."""
    scale = block_tokens_ / TRACE_BLOCK_TOKENS
    start = requests[0].timestamp_ms if requests else 0.0
    out: list[ServeRequest] = []
    for r in requests:
        full, rest = divmod(r.input_length, TRACE_BLOCK_TOKENS)
        length = full * block_tokens_ + -(-rest * block_tokens_ // TRACE_BLOCK_TOKENS)
        tokens: list[int] = []
        for block_id in r.hash_ids[: -(-length // block_tokens_)]:
            tokens.extend(int(t) % vocab_size for t in block_tokens(block_id)[:block_tokens_])
        out.append(
            ServeRequest(
                (r.timestamp_ms - start) / 1000,
                tuple(tokens[:length]),
                max(1, round(r.output_length * scale)),
            )
        )
    return out
