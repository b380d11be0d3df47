"""Causal grouped-query attention over KV that lives in kvtier's paged per-layer tensors.

A chunk's keys and values are first written into their blocks, then every key of the sequence
so far, the chunk's own included, is read back out of the blocks. Attention therefore sees the
same bytes whether an earlier block was computed a moment ago, was already on the GPU, or was
copied in from a lower tier, which is what makes cached and recomputed prefixes bit-identical.
A sliding-window layer masks every key more than ``window - 1`` positions behind its query.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvtier.engine.model import AttendFn
from kvtier.tiers.gpu.placement import KVPlacement


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, window: int | None = None
) -> torch.Tensor:
    """Attention of queries at positions ``q_start..`` over keys at positions ``0..S-1``.

    ``q`` is ``[T, heads, d]``, ``k`` and ``v`` are ``[S, kv_heads, d]`` with
    ``S >= q_start + T``; each group of ``heads // kv_heads`` query heads shares one KV head.
    With a ``window`` a query at ``p`` sees the keys at ``p - window + 1 .. p`` only.
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
    if window is not None:
        scores.masked_fill_(k_pos[None, :] <= q_pos[:, None] - window, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.bmm(probs, v.permute(1, 0, 2))
    return out.reshape(kv_heads, group, t, d).permute(2, 0, 1, 3).reshape(t, heads, d)


class PagedKV:
    """Reads and writes token rows of a sequence's blocks in kvtier's KV buffer.

    The buffer is in the canonical block order (``KVPlacement.allocate``), so every block the
    engine writes is one contiguous run that spills and loads as one copy. Each layer is seen
    as ``[num_blocks, kv_heads, block_size, 2 * d]``: per head and token, K then V.
    """

    def __init__(self, placement: KVPlacement, windows: Sequence[int | None] = ()):
        layout = placement.layout
        if layout.is_mla or layout.head_size_v != layout.head_size:
            raise ValueError("the reference engine needs K and V of one head size")
        self.layout = layout
        self.caches = placement.layer_views()
        self.windows = list(windows) or [None] * layout.num_layers
        """Each layer's sliding window in tokens (None: full attention)."""

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
        self._write_rows(layer, block_table.index_select(0, positions // bs), positions % bs, k, v)

    def _write_rows(
        self,
        layer: int,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        d = self.layout.head_size
        cache = self.caches[layer]
        cache[blocks, :, offsets, :d] = k
        cache[blocks, :, offsets, d:] = v

    def read(
        self, layer: int, block_table: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[num_tokens, kv_heads, d]`` of the sequence's first tokens."""
        bs, d = self.layout.block_size, self.layout.head_size
        ids = block_table[: -(-num_tokens // bs)]
        pages = self.caches[layer].index_select(0, ids)  # [n, heads, tokens, 2d]
        rows = pages.transpose(1, 2).reshape(-1, self.layout.num_kv_heads, 2 * d)[:num_tokens]
        return rows[..., :d].contiguous(), rows[..., d:].contiguous()

    def attend_fn(self, block_table: torch.Tensor, positions: torch.Tensor, start: int) -> AttendFn:
        """An ``AttendFn`` for a chunk of consecutive positions beginning at ``start``."""
        end = start + positions.numel()

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.write(layer, block_table, positions, k, v)
            keys, values = self.read(layer, block_table, end)
            return causal_attention(q, keys, values, start, self.windows[layer])

        return attend

    def decode_attend_fn(
        self,
        block_tables: Sequence[torch.Tensor],
        positions: Sequence[int],
        bucket_height: int | None = None,
    ) -> AttendFn:
        """An ``AttendFn`` for one new token of each of several sequences.

        Row ``i`` is the token at ``positions[i]`` of the sequence whose blocks are
        ``block_tables[i]``; rows beyond them pad the batch: they write nothing and attend to
        nothing (their output is zero). Each row attends alone (a few small kernels per row
        and layer), or, given ``bucket_height``, with every row whose keys fill the same power
        of two of blocks, in batches that many rows high (``_Bucket``): a GPU step then
        launches a few kernels per layer and bucket instead of per row.
        """
        bs = self.layout.block_size
        n = len(block_tables)
        device = self.caches[0].device
        blocks = torch.cat(
            [table[p // bs : p // bs + 1] for table, p in zip(block_tables, positions, strict=True)]
        )
        offsets = torch.tensor([p % bs for p in positions], dtype=torch.long, device=device)
        spans: dict[int, list[int]] = {}
        if bucket_height is not None:
            for i, pos in enumerate(positions):
                spans.setdefault(1 << (pos // bs).bit_length(), []).append(i)
        buckets: list[_Bucket] = []
        for span, rows in spans.items():
            tables = [block_tables[i] for i in rows]
            buckets.append(_Bucket(self, tables, [positions[i] for i in rows], span, bucket_height))
        rows_of = [torch.tensor(rows, device=device) for rows in spans.values()]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self._write_rows(layer, blocks, offsets, k[:n], v[:n])
            out = torch.zeros_like(q)
            for bucket, rows in zip(buckets, rows_of, strict=True):
                out.index_copy_(0, rows, bucket.attend(layer, q.index_select(0, rows)))
            if bucket_height is not None:
                return out
            for i, (table, pos) in enumerate(zip(block_tables, positions, strict=True)):
                keys, values = self.read(layer, table, pos + 1)
                out[i : i + 1] = causal_attention(
                    q[i : i + 1], keys, values, pos, self.windows[layer]
                )
            return out

        return attend


class _Bucket:
    """Decode rows whose keys fit ``span`` blocks, attended together in a batch ``height`` rows
    high (those beyond the rows pad it: they attend to one key and are dropped).

    Every shape here is fixed by ``height`` and ``span`` alone, so a row's bits never depend
    on which rows share its bucket (a matmul may round differently with its shapes). Keys past
    a row's position are masked and their values zeroed: a block's unwritten tail holds
    whatever bytes it last held, which may not even be numbers.
    """

    def __init__(
        self,
        kv: PagedKV,
        tables: Sequence[torch.Tensor],
        positions: Sequence[int],
        span: int,
        height: int,
    ):
        if len(tables) > height:
            raise ValueError(f"{len(tables)} rows do not fit a bucket {height} rows high")
        layout = kv.layout
        bs = layout.block_size
        device = kv.caches[0].device
        self.kv = kv
        self.height = height
        self.span_tokens = span * bs
        ids = torch.zeros((height, span), dtype=torch.long, device=device)
        for r, (table, pos) in enumerate(zip(tables, positions, strict=True)):
            ids[r, : pos // bs + 1] = table[: pos // bs + 1]
        self.ids = ids.view(-1)
        pos = torch.zeros(height, dtype=torch.long, device=device)
        pos[: len(positions)] = torch.tensor(list(positions), device=device)
        k_pos = torch.arange(self.span_tokens, device=device)
        causal = k_pos[None, :] <= pos[:, None]
        self.valid = {
            w: causal if w is None else causal & (k_pos[None, :] > pos[:, None] - w)
            for w in set(kv.windows)
        }
        self.rows = len(tables)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """``q`` (``[rows, heads, d]``) attended over its rows' keys: ``[rows, heads, d]``."""
        layout = self.kv.layout
        kv_heads, d, h = layout.num_kv_heads, layout.head_size, self.height
        heads = q.shape[1]
        pages = self.kv.caches[layer].index_select(0, self.ids)  # [h * span, kvh, bs, 2d]
        kv = pages.view(h, -1, kv_heads, layout.block_size, 2 * d).transpose(1, 2)
        kv = kv.reshape(h, kv_heads, self.span_tokens, 2 * d)
        valid = self.valid[self.kv.windows[layer]]
        values = torch.where(valid[:, None, :, None], kv[..., d:], 0)
        padded = torch.cat([q, q[:1].expand(h - self.rows, -1, -1)])
        qh = padded.view(h, kv_heads, heads // kv_heads, d)
        scores = torch.matmul(qh, kv[..., :d].transpose(-1, -2)).float() * (1.0 / math.sqrt(d))
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).reshape(h, heads, d)[: self.rows]
