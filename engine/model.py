"""The decoder's weights and per-token math; attention over the KV is left to the caller.

``Decoder.forward`` runs a chunk of tokens through every layer and hands each layer's rotated
queries, keys and values to an ``attend`` callable, which writes the keys and values wherever
the KV lives (paged blocks in the engine, a plain tensor in a test's dense reference) and
returns the attention output. Everything here is row-wise, so the bits of a token's result
depend only on its own inputs and on the shapes of the chunk it was computed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtier.engine.config import ModelConfig

AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(layer, q [T, heads, d], k [T, kv_heads, d], v [T, kv_heads, d]) -> [T, heads, d]``."""


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer; projections are stored ``[out, in]`` as ``F.linear`` expects."""

    attn_norm: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as Llama does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rope_angles(
    positions: torch.Tensor, head_size: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cosines and sines (``[T, 1, head_size]``, float32) that rotate the tokens at
    ``positions``: the same for every layer, so a forward pass computes them once."""
    d = head_size
    inv_freq = 1.0 / theta ** (
        torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d
    )
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    return cos, sin


def apply_rope(x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotates ``x`` (``[T, heads, d]``) by its tokens' ``rope_angles``, rotate-half
    convention."""
    cos, sin = angles
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Decoder:
    """A Llama-style decoder with seeded random weights on ``device``."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        gen = torch.Generator(device=self.device).manual_seed(config.seed)
        c = config

        def linear(out_features: int, in_features: int) -> torch.Tensor:
            w = torch.randn(out_features, in_features, generator=gen, device=self.device)
            return (w / math.sqrt(in_features)).to(c.dtype)

        def norm() -> torch.Tensor:
            w = 1.0 + 0.1 * torch.randn(c.hidden_size, generator=gen, device=self.device)
            return w.to(c.dtype)

        qkv_out = (c.num_heads + 2 * c.num_kv_heads) * c.head_size
        self.embed = torch.randn(c.vocab_size, c.hidden_size, generator=gen, device=self.device).to(
            c.dtype
        )
        self.layers = [
            LayerWeights(
                attn_norm=norm(),
                wqkv=linear(qkv_out, c.hidden_size),
                wo=linear(c.hidden_size, c.num_heads * c.head_size),
                mlp_norm=norm(),
                w_gate_up=linear(2 * c.intermediate_size, c.hidden_size),
                w_down=linear(c.hidden_size, c.intermediate_size),
            )
            for _ in range(c.num_layers)
        ]
        self.final_norm = norm()
        self.lm_head = linear(c.vocab_size, c.hidden_size)

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        """Final normed hidden states ``[T, hidden]`` of a chunk of tokens at ``positions``."""
        c = self.config
        q_size = c.num_heads * c.head_size
        kv_size = c.num_kv_heads * c.head_size
        h = self.embed.index_select(0, token_ids)
        angles = rope_angles(positions, c.head_size, c.rope_theta)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.attn_norm, c.rms_eps)
            q, k, v = F.linear(x, layer.wqkv).split([q_size, kv_size, kv_size], dim=-1)
            q = apply_rope(q.view(-1, c.num_heads, c.head_size), angles)
            k = apply_rope(k.view(-1, c.num_kv_heads, c.head_size), angles)
            v = v.reshape(-1, c.num_kv_heads, c.head_size)
            out = attend(i, q, k, v)
            h = h + F.linear(out.reshape(-1, q_size), layer.wo)
            x = rms_norm(h, layer.mlp_norm, c.rms_eps)
            gate, up = F.linear(x, layer.w_gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.w_down)
        return rms_norm(h, self.final_norm, c.rms_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[T, vocab]`` of final hidden states."""
        return F.linear(hidden, self.lm_head).float()
