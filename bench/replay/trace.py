"""Request traces in the Mooncake format, and the kvtier block hashes their prompts imply.

One JSON object a line: ``timestamp`` (ms from the start), ``input_length`` and
``output_length`` (tokens) and ``hash_ids``, the prompt's 512-token blocks as remapped ids
(two prompts share a prefix exactly as far as their lists agree). ``TraceHasher`` gives each id
a deterministic 512-token content drawn from a generator seeded by the id and hashes it with
kvtier's own chain, so the trace's sharing comes out of real block hashes. Only full blocks are
hashed: the last block is cut to ``input_length``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvtier.tiers.hashing import BlockHash, Namespace, hash_block_chain

TRACE_BLOCK_TOKENS = 512
VOCAB_SIZE = 32000


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: arrival, prompt and output lengths, and its prompt's block ids."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.input_length <= 0 or self.output_length < 0:
            raise ValueError(f"bad lengths in {self}")
        blocks = -(-self.input_length // TRACE_BLOCK_TOKENS)
        if len(self.hash_ids) < blocks:
            raise ValueError(
                f"{self.input_length} input tokens need {blocks} hash ids, got {len(self.hash_ids)}"
            )

    @property
    def num_full_blocks(self) -> int:
        return self.input_length // TRACE_BLOCK_TOKENS


def load_trace(path: str | os.PathLike[str]) -> list[TraceRequest]:
    """Reads a JSON-lines trace, in arrival order; a malformed line raises with its number."""
    requests: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                requests.append(
                    TraceRequest(
                        float(record["timestamp"]),
                        int(record["input_length"]),
                        int(record["output_length"]),
                        tuple(int(i) for i in record["hash_ids"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a trace record: {e}") from e
    requests.sort(key=lambda r: r.timestamp_ms)
    return requests


def write_trace(path: str | os.PathLike[str], requests: Iterable[TraceRequest]) -> None:
    """Writes requests in the same JSON-lines format ``load_trace`` reads."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            record = {
                "timestamp": r.timestamp_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(record) + "\n")


def block_tokens(block_id: int) -> np.ndarray:
    """The 512 token ids that trace block ``block_id`` stands for (seeded by the id)."""
    rng = np.random.Generator(np.random.PCG64(block_id))
    return rng.integers(0, VOCAB_SIZE, TRACE_BLOCK_TOKENS, dtype=np.int32)


class TraceHasher:
    """Turns a request's ``hash_ids`` into kvtier block hashes of its full prompt blocks.

    A (parent hash, id) pair always yields the same child, so it is remembered: each distinct
    block's tokens are generated and hashed once however many prompts repeat it.
    """

    def __init__(self, namespace: Namespace):
        self._seed = namespace.seed
        self._children: dict[tuple[BlockHash, int], BlockHash] = {}

    def hashes(self, request: TraceRequest) -> list[BlockHash]:
        parent = self._seed
        out: list[BlockHash] = []
        for block_id in request.hash_ids[: request.num_full_blocks]:
            key = (parent, block_id)
            child = self._children.get(key)
            if child is None:
                child = hash_block_chain(parent, block_tokens(block_id), TRACE_BLOCK_TOKENS)[0]
                self._children[key] = child
            out.append(child)
            parent = child
        return out

    @property
    def distinct_blocks(self) -> int:
        return len(self._children)
