"""The reference engine's model shape: a Llama-style decoder and the KV layout it implies.

``ModelConfig.tiny()`` is the few-thousand-parameter model the CPU tests run in float32;
``ModelConfig.llama_1b()`` has the shape of Llama 3.2 1B for GPU benchmarks. Weights are random
but seeded, so two engines built from one config compute the same function bit for bit; the
seed and every size enter ``model_id``, hence the hash namespace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.tiers.layout import KVLayout


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Sizes of a decoder with grouped-query attention, RoPE, RMSNorm and a SwiGLU MLP."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_size % 2:
            raise ValueError(f"RoPE needs an even head_size, got {self.head_size}")

    @classmethod
    def tiny(cls, **overrides: object) -> ModelConfig:
        """The CPU test model (float32, two layers, GQA with two query heads per KV head)."""
        return cls(**overrides)  # type: ignore[arg-type]

    @classmethod
    def llama_1b(cls, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> ModelConfig:
        """Llama 3.2 1B's shape: 16 layers, 32 query and 8 KV heads of 64, 128k vocabulary."""
        return cls(
            vocab_size=128256,
            hidden_size=2048,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            head_size=64,
            intermediate_size=8192,
            rope_theta=500000.0,
            dtype=dtype,
            seed=seed,
        )

    @property
    def model_id(self) -> str:
        """Names this exact function (sizes, dtype and seed) in the hash namespace."""
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"kvtier-ref:v{self.vocab_size}:h{self.hidden_size}:l{self.num_layers}:"
            f"q{self.num_heads}:kv{self.num_kv_heads}:d{self.head_size}:"
            f"i{self.intermediate_size}:t{self.rope_theta:g}:e{self.rms_eps:g}:{dtype}:s{self.seed}"
        )

    @property
    def num_params(self) -> int:
        h, d = self.hidden_size, self.head_size
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab_size * h + h

    def kv_layout(self, block_size: int) -> KVLayout:
        """This model's KV block: every layer's ``[kv_heads, block_size, K then V]`` page."""
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            block_size=block_size,
            dtype=self.dtype,
        )
