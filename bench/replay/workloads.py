"""Seeded synthetic traces in the Mooncake format: chat, RAG, agent and no-reuse traffic.

Every generator returns ``TraceRequest``s sorted by arrival, with 512-token block ids that two
requests share exactly where their prompts share a prefix, so they replay like a real trace.

* ``chat``: multi-turn conversations behind one shared system prompt; each turn's prompt is the
  previous prompt, the previous answer and a new message.
* ``rag``: a system prompt, then retrieved documents drawn with Zipf popularity (the first
  document is the reusable part), then a short question.
* ``agent``: sessions of many short steps on a long shared tool-definition prefix; each step
  appends a tool result and a short answer to the context.
* ``unique``: nothing is ever shared; shows what kvtier costs when it cannot help.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from kvtier.bench.replay.trace import TRACE_BLOCK_TOKENS, TraceRequest

BS = TRACE_BLOCK_TOKENS


class _Ids:
    """Fresh block ids from a counter."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def take(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


def _extend(ids: _Ids, prefix_ids: list[int], prefix_len: int, new_len: int) -> list[int]:
    """Ids of a prompt of ``new_len`` tokens that continues one of ``prefix_len`` tokens.

    The old prompt's full blocks are kept; its partial last block now holds new tokens, so it
    and everything after it get fresh ids.
    """
    keep = prefix_ids[: prefix_len // BS]
    return keep + ids.take(-(-new_len // BS) - len(keep))


def chat(seed: int = 0, conversations: int = 300, duration_s: float = 1800.0) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.take(2)
    out: list[TraceRequest] = []
    for _ in range(conversations):
        t = rng.uniform(0, duration_s) * 1000
        prompt_ids, length = list(system), 2 * BS
        answer = 0
        for _turn in range(int(rng.integers(2, 9))):
            new_len = length + answer + int(rng.integers(50, 1500))
            prompt_ids = _extend(ids, prompt_ids, length, new_len)
            length = new_len
            answer = int(rng.integers(50, 800))
            out.append(TraceRequest(t, length, answer, tuple(prompt_ids)))
            t += rng.uniform(10, 120) * 1000
    return sorted(out, key=lambda r: r.timestamp_ms)


def rag(
    seed: int = 0, requests: int = 3000, documents: int = 400, duration_s: float = 1800.0
) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.take(1)
    doc_blocks = [ids.take(int(rng.integers(2, 7))) for _ in range(documents)]
    weights = 1.0 / np.arange(1, documents + 1) ** 1.1
    weights /= weights.sum()
    out: list[TraceRequest] = []
    for t in np.sort(rng.uniform(0, duration_s, requests)) * 1000:
        picked = rng.choice(documents, size=3, replace=False, p=weights)
        # The first document follows the system prompt, so its ids are its own; documents in
        # later positions follow different text each time and are fresh blocks.
        prompt_ids = system + doc_blocks[picked[0]]
        rest = sum(len(doc_blocks[d]) for d in picked[1:]) * BS + int(rng.integers(30, 400))
        length = len(prompt_ids) * BS + rest
        prompt_ids = prompt_ids + ids.take(-(-rest // BS))
        out.append(TraceRequest(float(t), length, int(rng.integers(50, 400)), tuple(prompt_ids)))
    return out


def agent(seed: int = 0, sessions: int = 120, duration_s: float = 1800.0) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    tools = ids.take(8)
    out: list[TraceRequest] = []
    for _ in range(sessions):
        t = rng.uniform(0, duration_s) * 1000
        prompt_ids, length = list(tools), 8 * BS + int(rng.integers(100, 600))
        prompt_ids = _extend(ids, prompt_ids, 8 * BS, length)
        for _step in range(int(rng.integers(10, 31))):
            answer = int(rng.integers(30, 200))
            out.append(TraceRequest(t, length, answer, tuple(prompt_ids)))
            new_len = length + answer + int(rng.integers(100, 1200))
            prompt_ids = _extend(ids, prompt_ids, length, new_len)
            length = new_len
            t += rng.uniform(2, 15) * 1000
    return sorted(out, key=lambda r: r.timestamp_ms)


def unique(seed: int = 0, requests: int = 3000, duration_s: float = 900.0) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    out: list[TraceRequest] = []
    for t in np.sort(rng.uniform(0, duration_s, requests)) * 1000:
        length = int(rng.integers(200, 16 * BS))
        out.append(
            TraceRequest(
                float(t), length, int(rng.integers(20, 600)), tuple(ids.take(-(-length // BS)))
            )
        )
    return out


WORKLOADS: dict[str, Callable[[int], list[TraceRequest]]] = {
    "chat": chat,
    "rag": rag,
    "agent": agent,
    "unique": unique,
}
