"""The requests a serving run offers: whole conversations sampled from a trace, in tokens.

A request continues an earlier one (a conversation's next turn) when that one's full-block
prompt, at least two blocks long, begins it. Sampling whole conversations keeps every sampled
turn's predecessors, hence the trace's reuse; arrival times are kept as they are, for the
serving run to scale. Each 512-token trace block becomes ``block_tokens`` tokens of the model's
vocabulary, drawn from the block's id as the replay does, so two prompts share a prefix exactly
as far as their blocks agree.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.bench.replay.trace import TRACE_BLOCK_TOKENS, TraceRequest, block_tokens

MIN_TURN_BLOCKS = 2
"""Shorter shared prefixes are a system prompt that every conversation starts with."""


@dataclass(frozen=True, slots=True)
class ServeRequest:
    """One request of a serving run: when it arrives (trace seconds), its prompt, its output."""

    arrival_s: float
    prompt: tuple[int, ...]
    output_tokens: int


def conversations(requests: Sequence[TraceRequest]) -> list[list[int]]:
    """Indices of ``requests`` (in arrival order) grouped by conversation."""
    nodes: dict[tuple[int, int], int] = {}
    owner: dict[int, int] = {}
    groups: list[list[int]] = []
    for index, request in enumerate(requests):
        full = request.hash_ids[: request.num_full_blocks]
        node, group = 0, None
        for depth, block_id in enumerate(full, 1):
            node = nodes.get((node, block_id), -1)
            if node < 0:
                break
            if depth >= MIN_TURN_BLOCKS and node in owner:
                group = owner[node]
        if group is None:
            group = len(groups)
            groups.append([])
        groups[group].append(index)
        node = 0
        for block_id in full:
            node = nodes.setdefault((node, block_id), len(nodes) + 1)
        if full:
            owner.setdefault(node, group)
    return groups


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
