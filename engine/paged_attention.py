"""Causal grouped-query attention over KV that lives in kvtier's paged per-layer tensors.

A chunk's keys and values are first written into their blocks, then every key of the sequence
so far, the chunk's own included, is read back out of the blocks. Attention therefore sees the
same bytes whether an earlier block was computed a moment ago, was already on the GPU, or was
copied in from a lower tier, which is what makes cached and recomputed prefixes bit-identical.
"""

from __future__ import annotations

import math

import torch

from kvtier.engine.model import AttendFn
from kvtier.tiers.layout import KVLayout


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int
) -> torch.Tensor:
    """Attention of queries at positions ``q_start..`` over keys at positions ``0..S-1``.

    ``q`` is ``[T, heads, d]``, ``k`` and ``v`` are ``[S, kv_heads, d]`` with
    ``S >= q_start + T``; each group of ``heads // kv_heads`` query heads shares one KV head.
    Softmax runs in float32. Returns ``[T, heads, d]``.
    """
    t, heads, d = q.shape
    s, kv_heads, _ = k.shape
    group = heads // kv_heads
    # [kv_heads, group * T, d]: the query heads of one KV head stacked, so one bmm per KV head.
    qh = q.reshape(t, kv_heads, group, d).permute(1, 2, 0, 3).reshape(kv_heads, group * t, d)
    scores = torch.bmm(qh, k.permute(1, 2, 0)).float() * (1.0 / math.sqrt(d))
    q_pos = torch.arange(q_start, q_start + t, device=q.device).repeat(group)
    k_pos = torch.arange(s, device=q.device)
    scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.bmm(probs, v.permute(1, 0, 2))
    return out.reshape(kv_heads, group, t, d).permute(2, 0, 1, 3).reshape(t, heads, d)


class PagedKV:
    """Reads and writes token rows of a sequence's blocks in per-layer KV tensors.

    The tensors follow ``layout`` with ``block_dim=1``: ``[2, num_blocks, block_size,
    kv_heads, d]``, K at index 0 and V at index 1.
    """

    def __init__(self, layout: KVLayout, kv_caches: list[torch.Tensor]):
        if layout.block_dim != 1 or layout.kv_parts != 2:
            raise ValueError("the reference engine needs K and V parts with block_dim=1")
        layout.check_tensors(kv_caches)
        self.layout = layout
        self.kv_caches = kv_caches

    def write(
        self,
        layer: int,
        block_table: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Stores rows ``k``, ``v`` (``[T, kv_heads, d]``) at their tokens' positions."""
        bs = self.layout.block_size
        blocks = block_table.index_select(0, positions // bs)
        offsets = positions % bs
        cache = self.kv_caches[layer]
        cache[0, blocks, offsets] = k
        cache[1, blocks, offsets] = v

    def read(
        self, layer: int, block_table: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[num_tokens, kv_heads, d]`` of the sequence's first tokens."""
        bs = self.layout.block_size
        ids = block_table[: -(-num_tokens // bs)]
        cache = self.kv_caches[layer]
        shape = (-1, self.layout.num_kv_heads, self.layout.head_size)
        k = cache[0].index_select(0, ids).reshape(shape)[:num_tokens]
        v = cache[1].index_select(0, ids).reshape(shape)[:num_tokens]
        return k, v

    def attend_fn(self, block_table: torch.Tensor, positions: torch.Tensor, start: int) -> AttendFn:
        """An ``AttendFn`` for a chunk of consecutive positions beginning at ``start``."""
        end = start + positions.numel()

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.write(layer, block_table, positions, k, v)
            keys, values = self.read(layer, block_table, end)
            return causal_attention(q, keys, values, start)

        return attend
