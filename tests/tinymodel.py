"""The tiny model of the vLLM connector's tests: its shape, and KV values known from the
token prefix alone.

``prefix_values`` gives every token KV values that depend only on the tokens up to it;
``check_then_write`` is what a forward pass does to the KV caches in the tests' fake model
runner: it checks that every earlier token of the request holds exactly its values (what
attention would read), then writes the new tokens'. A block loaded from kvtier with one
wrong byte fails that check.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

BLOCK = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
KV_HEADS, HEAD = 2, 16
BLOCK_BYTES = len(LAYERS) * 2 * BLOCK * KV_HEADS * HEAD * 2  # fp16, K and V
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": KV_HEADS,
    "num_hidden_layers": len(LAYERS),
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def prefix_values(tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), layers, heads, 2*head]`` fp16: token p's KV depends on tokens[:p+1]."""
    seeds = np.empty(len(tokens), dtype=np.uint64)
    h = 0
    for p, token in enumerate(tokens):
        h = xxhash.xxh64_intdigest(h.to_bytes(8, "little") + int(token).to_bytes(4, "little"))
        seeds[p] = h
    width = len(LAYERS) * KV_HEADS * 2 * HEAD
    idx = np.arange(1, width + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    mixed = (seeds[:, None] ^ idx[None, :]) * np.uint64(0xBF58476D1CE4E5B9)
    ints = (mixed >> np.uint64(40)) % np.uint64(2049)
    values = ints.astype(np.int64) - 1024  # every integer in [-1024, 1024] is exact in fp16
    shaped = values.reshape(len(tokens), len(LAYERS), KV_HEADS, 2 * HEAD)
    return torch.from_numpy(shaped).to(torch.float16)


def check_then_write(
    caches: dict[str, torch.Tensor], block_table: list[int], start: int, tokens: list[int], who: str
) -> None:
    """What a forward pass over ``tokens[start:]`` does to one rank's KV ``caches`` (one per
    layer): checks that every earlier token holds exactly its values, as attention would read
    them, then writes the scheduled tokens' values."""
    values = prefix_values(tokens)
    table = torch.tensor(block_table, dtype=torch.long)
    positions = torch.arange(len(tokens))
    blocks, offsets = table[positions // BLOCK], positions % BLOCK
    for layer, name in enumerate(LAYERS):
        cache = caches[name]
        seen = cache[blocks[:start], :, offsets[:start], :]
        assert torch.equal(seen, values[:start, layer]), (
            f"{who}: KV of tokens < {start} differs in layer {layer}"
        )
        cache[blocks[start:], :, offsets[start:], :] = values[start:, layer]
