"""The reference engine: one sequence at a time through the decoder on kvtier's block pool.

A prompt is hashed in blocks, its longest cached prefix is taken from whichever tier holds it
(``PrefixCache.match`` then ``claim``), the rest is prefilled in chunks, and the prompt's blocks
are named by their hashes so later prompts find them. Decode is greedy, one token a step.
Finishing frees the sequence's blocks tail first, so its unique tail is evicted before the
prefix it may share. A serving loop interleaves requests with ``begin``, ``prefill_chunk`` and
``decode_batch``: one chunk of one prompt at a time, and one greedy token for many sequences in
one forward pass.

Bit-exactness rests on three rules. Chunks start at multiples of ``chunk_blocks`` blocks
counted from position 0, so a given block is always computed in a chunk of the same shape.
A cached prefix is used only up to a chunk boundary, so the suffix is computed in exactly the
chunks a full recompute would use. And only blocks computed in a full prefill chunk are
cached: a block from a shorter last chunk or from decode steps (one-row matmuls) may differ
in its last bits from the same tokens prefilled in a full chunk. A batched decode pads its
rows to a height the caller fixes, since a matmul's rows may round differently with the number
of rows: a sequence's tokens then never depend on which others share its step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.engine.model import Decoder
from kvtier.engine.paged_attention import PagedKV
from kvtier.tiers.free_queue import KVBlock
from kvtier.tiers.hashing import BlockHash, Namespace, hash_prompt
from kvtier.tiers.stack import TierStack

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SequenceState:
    """One request in flight: tokens, block hashes, GPU blocks, where its prefix came from."""

    token_ids: list[int]
    num_prompt_tokens: int
    hashes: list[BlockHash]
    blocks: list[KVBlock] = field(default_factory=list)
    cached_tokens: int = 0
    gpu_hit_blocks: int = 0
    host_hit_blocks: int = 0
    disk_hit_blocks: int = 0
    last_logits: torch.Tensor | None = None
    num_computed: int = 0
    """Prompt tokens whose KV is in place: the cached prefix, then each chunk computed."""


@dataclass(slots=True)
class Generation:
    """A finished request: generated tokens, the logits after the prompt, prefix provenance."""

    tokens: list[int]
    first_logits: torch.Tensor
    cached_tokens: int
    gpu_hit_blocks: int
    host_hit_blocks: int
    disk_hit_blocks: int


class Engine:
    """Runs prompts through ``model`` with its KV in ``stack``'s pool and prefix cache."""

    def __init__(
        self,
        model: Decoder,
        stack: TierStack,
        *,
        chunk_blocks: int = 1,
        bucketed_decode: bool | None = None,
    ):
        """``bucketed_decode`` (default: on a GPU) batches a decode step's attention by key
        length (``PagedKV.decode_attend_fn``); else each sequence attends alone."""
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be positive, got {chunk_blocks}")
        want = model.config.kv_layout(stack.layout.block_size)
        if stack.layout != want:
            raise ValueError(f"tier stack layout {stack.layout} is not the model's {want}")
        if _concrete(stack.placement.device) != _concrete(model.device):
            raise ValueError(f"KV on {stack.placement.device} but the model is on {model.device}")
        self.model = model
        self.stack = stack
        self.block_size = stack.layout.block_size
        self.chunk_blocks = chunk_blocks
        self.namespace = Namespace(model.config.model_id, stack.layout.signature)
        windows = [model.config.window(layer) for layer in range(model.config.num_layers)]
        self.kv = PagedKV(stack.placement, windows)
        self.bucketed_decode = (
            model.device.type == "cuda" if bucketed_decode is None else bucketed_decode
        )

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_blocks * self.block_size

    def prefill(self, prompt: Sequence[int]) -> SequenceState:
        """Takes the cached prefix, computes the rest, caches the prompt's stable blocks.

        The returned state holds its blocks (give them back with ``finish``) and the logits
        of the token after the prompt in ``last_logits``.
        """
        seq = self.begin(prompt)
        done = False
        while not done:
            done = self.prefill_chunk(seq)
        return seq

    def begin(self, prompt: Sequence[int]) -> SequenceState:
        """Takes the cached prefix and the blocks for the rest of the prompt; computes nothing.

        ``prefill_chunk`` then computes the rest one chunk at a time. Raises ``RuntimeError``
        (holding nothing) if the pool lacks the blocks.
        """
        n = len(prompt)
        if n == 0:
            raise ValueError("empty prompt")
        bs, pool = self.block_size, self.stack.pool
        hashes = hash_prompt(self.namespace, prompt, bs)
        match = self.stack.cache.match(hashes, n)
        match = match.truncate(match.num_blocks // self.chunk_blocks * self.chunk_blocks)
        claimed = self.stack.cache.claim(match)
        blocks = claimed.blocks
        # A lower-tier block may have vanished between match and claim: re-align to a chunk.
        keep = len(blocks) // self.chunk_blocks * self.chunk_blocks
        if keep < len(blocks):
            pool.free_blocks(reversed(blocks[keep:]))
            del blocks[keep:]
        if claimed.transfer is not None:
            claimed.transfer.order_before()
        need = -(-n // bs) - len(blocks)
        if need > pool.num_free:
            pool.free_blocks(reversed(blocks))
            raise RuntimeError(
                f"prompt needs {need} more blocks, the pool has {pool.num_free} free"
            )
        seq = SequenceState(list(prompt), n, hashes, blocks, cached_tokens=keep * bs)
        seq.num_computed = seq.cached_tokens
        seq.gpu_hit_blocks = min(claimed.gpu_hits, keep)
        seq.host_hit_blocks = min(claimed.host_hits, keep - seq.gpu_hit_blocks)
        seq.disk_hit_blocks = keep - seq.gpu_hit_blocks - seq.host_hit_blocks
        self._add_blocks(seq, need)
        return seq

    def prefill_chunk(self, seq: SequenceState) -> bool:
        """Computes the prompt's next chunk and names its blocks if it is a full chunk.

        Returns True once the whole prompt is in place; ``last_logits`` is then set.
        """
        n, bs = seq.num_prompt_tokens, self.block_size
        start = seq.num_computed
        if start >= n:
            raise ValueError(f"the prompt's {n} tokens are already prefilled")
        end = min(start + self.chunk_tokens, n)
        hidden = self._forward(seq, start, end)
        seq.num_computed = end
        if end - start == self.chunk_tokens:
            first, last = start // bs, end // bs
            self.stack.pool.cache_full_blocks(seq.blocks[first:last], seq.hashes[first:last])
        if end < n:
            return False
        seq.last_logits = self.model.logits(hidden[-1:])[0]
        logger.debug(
            "prefill of %d tokens: %d cached (gpu %d, host %d, disk %d blocks)",
            n,
            seq.cached_tokens,
            seq.gpu_hit_blocks,
            seq.host_hit_blocks,
            seq.disk_hit_blocks,
        )
        return True

    def decode(self, seq: SequenceState) -> int:
        """Appends the greedy next token and computes the logits after it; returns the token."""
        token = int(torch.argmax(seq.last_logits))
        seq.token_ids.append(token)
        pos = len(seq.token_ids) - 1
        if pos // self.block_size >= len(seq.blocks):
            self._add_blocks(seq, 1)
        hidden = self._forward(seq, pos, pos + 1)
        seq.last_logits = self.model.logits(hidden)[0]
        return token

    def decode_batch(self, seqs: Sequence[SequenceState], rows: int | None = None) -> list[int]:
        """``decode`` for several sequences in one forward pass; returns each one's token.

        The batch is padded with idle rows to ``rows`` (default: no padding), so that with a
        fixed ``rows`` each sequence's bits are those it would get in any other batch.
        """
        height = len(seqs) if rows is None else rows
        if not seqs or height < len(seqs):
            raise ValueError(f"{len(seqs)} sequences do not fit a batch of {height} rows")
        # one argmax and one read back for the whole batch, not a device sync per sequence
        tokens: list[int] = torch.stack([seq.last_logits for seq in seqs]).argmax(-1).tolist()
        positions: list[int] = []
        for seq, token in zip(seqs, tokens, strict=True):
            seq.token_ids.append(token)
            pos = len(seq.token_ids) - 1
            if pos // self.block_size >= len(seq.blocks):
                self._add_blocks(seq, 1)
            positions.append(pos)
        device = self.model.device
        pad = [0] * (height - len(seqs))
        ids = torch.tensor(tokens + pad, dtype=torch.long, device=device)
        pos_t = torch.tensor(positions + pad, dtype=torch.long, device=device)
        tables = [
            torch.tensor([b.block_id for b in seq.blocks], dtype=torch.long, device=device)
            for seq in seqs
        ]
        attend = self.kv.decode_attend_fn(
            tables, positions, height if self.bucketed_decode else None
        )
        hidden = self.model.forward(ids, pos_t, attend)
        logits = self.model.logits(hidden)
        for i, seq in enumerate(seqs):
            seq.last_logits = logits[i]
        return tokens

    def finish(self, seq: SequenceState) -> None:
        """Gives the sequence's blocks back, tail first; the cached ones stay findable."""
        self.stack.pool.free_blocks(reversed(seq.blocks))
        seq.blocks = []

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> Generation:
        """Prefill, ``max_new_tokens`` greedy tokens, finish."""
        seq = self.prefill(prompt)
        first = seq.last_logits
        try:
            tokens = [self.decode(seq) for _ in range(max_new_tokens)]
        finally:
            self.finish(seq)
        return Generation(
            tokens,
            first,
            seq.cached_tokens,
            seq.gpu_hit_blocks,
            seq.host_hit_blocks,
            seq.disk_hit_blocks,
        )

    def _add_blocks(self, seq: SequenceState, n: int) -> None:
        if n <= 0:
            return
        pool = self.stack.pool
        new = pool.get_new_blocks(n)
        # A recycled block may still be read by its spill; our writes go after that copy.
        for transfer in pool.pending_reads(new):
            transfer.order_before()
        seq.blocks.extend(new)

    def _forward(self, seq: SequenceState, start: int, end: int) -> torch.Tensor:
        device = self.model.device
        tokens = torch.tensor(seq.token_ids[start:end], dtype=torch.long, device=device)
        positions = torch.arange(start, end, dtype=torch.long, device=device)
        table = torch.tensor([b.block_id for b in seq.blocks], dtype=torch.long, device=device)
        return self.model.forward(tokens, positions, self.kv.attend_fn(table, positions, start))


def _concrete(device: torch.device) -> torch.device:
    """``cuda`` names the current CUDA device; tensors always carry its index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
