"""The reference engine's model shape: a Llama-style decoder and the KV layout it implies.

``ModelConfig.tiny()`` is the few-thousand-parameter model the CPU tests run in float32;
``ModelConfig.hybrid()`` is the same with sliding-window layers between full-attention ones
(as gpt-oss and Gemma alternate them); ``ModelConfig.llama_1b()`` has the shape of Llama 3.2
1B for GPU benchmarks. Weights are random but seeded, so two engines built from one config
compute the same function bit for bit; the seed, every size and the window enter
``model_id``, hence the hash namespace.
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
    sliding_window: int | None = None
    """Tokens a sliding-window layer attends to, itself included (None: no such layer)."""
    sliding_layers: tuple[int, ...] = ()
    """The layers that attend through the sliding window; the others see every token."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_size % 2:
            raise ValueError(f"RoPE needs an even head_size, got {self.head_size}")
        if bool(self.sliding_layers) != (self.sliding_window is not None):
            raise ValueError("sliding_window and sliding_layers come together")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if any(not 0 <= layer < self.num_layers for layer in self.sliding_layers):
            raise ValueError(f"sliding_layers {self.sliding_layers} outside {self.num_layers}")

    @classmethod
    def tiny(cls, **overrides: object) -> ModelConfig:
        """The CPU test model (float32, two layers, GQA with two query heads per KV head)."""
        return cls(**overrides)  # type: ignore[arg-type]

    @classmethod
    def hybrid(cls, sliding_window: int = 32, **overrides: object) -> ModelConfig:
        """The CPU test model with a sliding window on every other layer (first, third, ...),
        full attention on the rest."""
        num_layers = int(overrides.pop("num_layers", 4))
        return cls(
            num_layers=num_layers,
            sliding_window=sliding_window,
            sliding_layers=tuple(range(0, num_layers, 2)),
            **overrides,  # type: ignore[arg-type]
        )

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` in tokens, or None for full attention."""
        return self.sliding_window if layer in self.sliding_layers else None

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
        window = ""
        if self.sliding_window is not None:
            layers = ",".join(map(str, self.sliding_layers))
            window = f":w{self.sliding_window}@{layers}"
        return (
            f"kvtier-ref:v{self.vocab_size}:h{self.hidden_size}:l{self.num_layers}:"
            f"q{self.num_heads}:kv{self.num_kv_heads}:d{self.head_size}:"
            f"i{self.intermediate_size}:t{self.rope_theta:g}:e{self.rms_eps:g}:{dtype}:s{self.seed}"
            f"{window}"
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
