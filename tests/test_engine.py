"""The reference engine against a dense implementation, across chunk sizes, and its pool use."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from kvtier.engine.config import ModelConfig
from kvtier.engine.engine import Engine
from kvtier.engine.model import Decoder
from kvtier.engine.paged_attention import PagedKV, causal_attention
from kvtier.tiers.gpu.placement import KVPlacement
from kvtier.tiers.stack import build_stack

BLOCK = 16
CONFIG = ModelConfig.tiny()


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder(CONFIG)


def prompt(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist()


def make_engine(
    model: Decoder, num_blocks: int = 32, chunk_blocks: int = 1, bucketed: bool = False
) -> Engine:
    return Engine(
        model,
        build_stack(model.config.kv_layout(BLOCK), num_blocks),
        chunk_blocks=chunk_blocks,
        bucketed_decode=bucketed,
    )


def dense_logits(model: Decoder, token_ids: list[int]) -> torch.Tensor:
    """Logits after every position, whole sequence at once, with SDPA on contiguous KV (a
    sliding-window layer masks the keys more than ``window - 1`` tokens back)."""
    config = model.config
    group = config.num_heads // config.num_kv_heads
    pos = torch.arange(len(token_ids))

    def attend(layer: int, q, k, v):
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
        mask = pos[None, :] <= pos[:, None]
        window = config.window(layer)
        if window is not None:
            mask &= pos[None, :] > pos[:, None] - window
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)

    ids = torch.tensor(token_ids, device=model.device)
    pos = pos.to(model.device)
    hidden = model.forward(ids, pos, attend)
    return model.logits(hidden)


def test_causal_attention_matches_sdpa():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 8, generator=gen)
    k = torch.randn(12, 2, 8, generator=gen)
    v = torch.randn(12, 2, 8, generator=gen)
    out = causal_attention(q, k, v, q_start=7)
    mask = torch.arange(12)[None, :] <= torch.arange(7, 12)[:, None]
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, dim=1).transpose(0, 1),
        v.repeat_interleave(2, dim=1).transpose(0, 1),
        attn_mask=mask,
    ).transpose(0, 1)
    torch.testing.assert_close(out, want)


def test_paged_kv_round_trip():
    layout = CONFIG.kv_layout(4)
    placement = KVPlacement.allocate(layout, 6)
    kv = PagedKV(placement)
    table = torch.tensor([5, 2, 0])
    k = torch.randn(10, CONFIG.num_kv_heads, CONFIG.head_size)
    v = torch.randn(10, CONFIG.num_kv_heads, CONFIG.head_size)
    kv.write(1, table, torch.arange(10), k, v)
    keys, values = kv.read(1, table, 10)
    assert torch.equal(keys, k) and torch.equal(values, v)
    # Token 5 of the sequence is token 1 of block 2: its K then V, per head.
    d = CONFIG.head_size
    assert torch.equal(kv.caches[1][2, :, 1, :d], k[5])
    assert torch.equal(kv.caches[1][2, :, 1, d:], v[5])
    assert not kv.caches[0].any()
    # The block is one contiguous run in the canonical order: layer, head, token, K then V.
    block = placement.buffer[placement.block_offset(2) :][: layout.block_bytes]
    rows = layout.block_view(block.view(1, -1))[0]
    assert torch.equal(rows[1, :, 1, :d], k[5])


def test_generate_matches_dense_reference(model: Decoder):
    tokens = prompt(0, 3 * BLOCK + 5)
    out = make_engine(model).generate(tokens, max_new_tokens=BLOCK)
    want = dense_logits(model, tokens)[-1]
    torch.testing.assert_close(out.first_logits, want, rtol=1e-4, atol=1e-4)
    # Greedy decode agrees with recomputing the whole sequence densely at each step.
    seq = list(tokens)
    for token in out.tokens:
        assert token == int(torch.argmax(dense_logits(model, seq)[-1]))
        seq.append(token)


def test_hybrid_model_matches_dense_reference_with_windows():
    hybrid = Decoder(ModelConfig.hybrid(sliding_window=BLOCK + 3))
    engine = Engine(hybrid, build_stack(hybrid.config.kv_layout(BLOCK), 32), chunk_blocks=2)
    tokens = prompt(6, 4 * BLOCK + 7)
    out = engine.generate(tokens, max_new_tokens=BLOCK)
    want = dense_logits(hybrid, tokens)[-1]
    torch.testing.assert_close(out.first_logits, want, rtol=1e-4, atol=1e-4)
    seq = list(tokens)
    for token in out.tokens:
        assert token == int(torch.argmax(dense_logits(hybrid, seq)[-1]))
        seq.append(token)
    # The windows matter: the same weights attending to every token predict otherwise.
    full = Decoder(replace(hybrid.config, sliding_window=None, sliding_layers=()))
    assert not torch.allclose(dense_logits(full, tokens)[-1], want, rtol=1e-3, atol=1e-3)


def test_window_config_is_checked():
    with pytest.raises(ValueError, match="come together"):
        ModelConfig.tiny(sliding_window=8)
    with pytest.raises(ValueError, match="outside"):
        ModelConfig.tiny(sliding_window=8, sliding_layers=(5,))
    assert ModelConfig.hybrid().model_id != ModelConfig.hybrid(sliding_window=64).model_id


@pytest.mark.parametrize("chunk_blocks", [2, 3, 64])
def test_chunked_prefill_matches_single_block_chunks(model: Decoder, chunk_blocks: int):
    tokens = prompt(1, 7 * BLOCK + 3)
    base = make_engine(model, chunk_blocks=1).generate(tokens, max_new_tokens=4)
    other = make_engine(model, chunk_blocks=chunk_blocks).generate(tokens, max_new_tokens=4)
    torch.testing.assert_close(other.first_logits, base.first_logits, rtol=1e-4, atol=1e-4)
    assert other.tokens == base.tokens


def test_caches_only_blocks_of_full_chunks(model: Decoder):
    engine = make_engine(model, chunk_blocks=2)
    tokens = prompt(2, 5 * BLOCK + 1)  # chunks [0, 32) [32, 64) [64, 81): blocks 0-3 stable
    engine.generate(tokens, max_new_tokens=2 * BLOCK)
    assert len(engine.stack.pool.cached) == 4
    again = engine.generate(tokens, max_new_tokens=0)
    assert again.cached_tokens == 4 * BLOCK


def test_finish_frees_tail_first(model: Decoder):
    engine = make_engine(model, num_blocks=8)
    seq = engine.prefill(prompt(3, 3 * BLOCK + 2))
    ids = [b.block_id for b in seq.blocks]
    engine.finish(seq)
    pool = engine.stack.pool
    assert pool.num_free == 8
    order = [b.block_id for b in pool.free_queue.iter_from_head()]
    assert order[-len(ids) :] == ids[::-1]


def test_prompt_larger_than_pool_fails_cleanly(model: Decoder):
    engine = make_engine(model, num_blocks=4)
    engine.generate(prompt(4, 2 * BLOCK + 1), max_new_tokens=0)
    with pytest.raises(RuntimeError, match="more blocks"):
        engine.prefill(prompt(4, 2 * BLOCK) + prompt(5, 3 * BLOCK))
    assert engine.stack.pool.num_free == 4


def test_rejects_mismatched_layout(model: Decoder):
    stack = build_stack(ModelConfig.tiny(seed=1, head_size=8).kv_layout(BLOCK), 4)
    with pytest.raises(ValueError, match="layout"):
        Engine(model, stack)


def test_prefill_in_chunks_of_interleaved_requests_matches_prefill(model: Decoder):
    tokens = [prompt(6, 5 * BLOCK + 3), prompt(7, 3 * BLOCK + 9)]
    whole = [make_engine(model, chunk_blocks=2).prefill(t).last_logits for t in tokens]
    engine = make_engine(model, chunk_blocks=2)
    seqs = [engine.begin(t) for t in tokens]
    done = [False, False]
    while not all(done):
        for i, seq in enumerate(seqs):
            if not done[i]:
                done[i] = engine.prefill_chunk(seq)
    for seq, logits in zip(seqs, whole, strict=True):
        assert torch.equal(seq.last_logits, logits)
    assert len(engine.stack.pool.cached) == 4 + 2  # blocks of full chunks only
    with pytest.raises(ValueError, match="already prefilled"):
        engine.prefill_chunk(seqs[0])


@pytest.mark.parametrize("bucketed", [False, True], ids=["per-row", "bucketed"])
def test_decode_batch_of_fixed_height_is_independent_of_its_neighbours(
    model: Decoder, bucketed: bool
):
    def decode(seeds: list[int], rows: int, steps: int = 6) -> tuple[list[int], torch.Tensor]:
        engine = make_engine(model, num_blocks=64, bucketed=bucketed)
        seqs = [engine.prefill(prompt(seed, 20 + seed)) for seed in seeds]
        tokens = [engine.decode_batch(seqs, rows=rows)[0] for _ in range(steps)]
        return tokens, seqs[0].last_logits

    alone_tokens, alone_logits = decode([8], rows=4)
    # seeds 9 and 10 share the bucket of seed 8's keys for some steps (2 blocks), then not
    crowd_tokens, crowd_logits = decode([8, 9, 10], rows=4)
    assert crowd_tokens == alone_tokens
    assert torch.equal(crowd_logits, alone_logits)
    dense = dense_logits(model, prompt(8, 28) + alone_tokens[:-1])
    assert alone_tokens == dense[27:].argmax(-1).tolist()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def test_a_bucketed_decode_matches_the_dense_reference_with_windows(device: str):
    """Rows of several key lengths (buckets of 1, 2, 4 and 8 blocks, one of them shared by
    many rows) and sliding windows: each row's logits are those of its whole sequence computed
    densely, whatever the unwritten tails of their blocks hold."""
    hybrid = Decoder(ModelConfig.hybrid(sliding_window=BLOCK + 3), device=device)
    stack = build_stack(hybrid.config.kv_layout(BLOCK), 96, device=device)
    engine = Engine(hybrid, stack, bucketed_decode=True)
    for cache in engine.kv.caches:
        cache.fill_(float("nan"))
    lengths = (3, 3 * BLOCK, 6 * BLOCK + 1) + (BLOCK + 2,) * 5
    seqs = [engine.prefill(prompt(20 + i, n)) for i, n in enumerate(lengths)]
    for _ in range(3):
        engine.decode_batch(seqs, rows=len(seqs) + 1)
    for seq in seqs:
        want = dense_logits(hybrid, seq.token_ids)[-1]
        torch.testing.assert_close(seq.last_logits, want, rtol=1e-4, atol=1e-4)


def test_decode_batch_rejects_more_sequences_than_rows(model: Decoder):
    engine = make_engine(model)
    seqs = [engine.prefill(prompt(seed, 5)) for seed in (11, 12)]
    with pytest.raises(ValueError, match="do not fit"):
        engine.decode_batch(seqs, rows=1)
