"""How an engine's KV tensors are shaped, and how one block becomes one contiguous byte string.

Below the GPU a block is ONE contiguous byte string holding every layer (per layer: its K then
its V, or the MLA latent), so one block moves as one large copy. ``KVLayout`` knows the bytes of
a block, gathers many blocks out of the per-layer tensors into a ``[n, block_bytes]`` uint8
buffer and scatters them back. Its signature enters the hash namespace, so bytes stored for one
layout can never be loaded into another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def dtype_from_name(name: str) -> torch.dtype:
    """Maps ``"bfloat16"`` (or ``"torch.bfloat16"``) to the torch dtype, with a clear error."""
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported KV dtype {name!r}; known: {sorted(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The per-layer KV tensors of one engine (one tensor-parallel rank).

    Each layer's tensor has the shape ``layer_shape(num_blocks)``: by default
    ``[kv_parts, num_blocks, block_size, num_kv_heads, head_size]`` (``block_dim=1``, the
    flash-attention order), or ``[num_blocks, kv_parts, block_size, num_kv_heads, head_size]``
    with ``block_dim=0``, where one block of one layer is already contiguous. ``kv_parts`` is 2
    for K and V, 1 for an MLA latent cache.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype = torch.float16
    kv_parts: int = 2
    block_dim: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.kv_parts not in (1, 2):
            raise ValueError(f"kv_parts must be 1 (MLA latent) or 2 (K and V), got {self.kv_parts}")
        if self.block_dim not in (0, 1):
            raise ValueError(f"block_dim must be 0 or 1, got {self.block_dim}")

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V together)."""
        return (
            self.kv_parts * self.block_size * self.num_kv_heads * self.head_size * self.elem_bytes
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole block: every layer, K then V within each layer."""
        return self.num_layers * self.layer_block_bytes

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        inner = (self.block_size, self.num_kv_heads, self.head_size)
        if self.block_dim == 0:
            return (num_blocks, self.kv_parts, *inner)
        return (self.kv_parts, num_blocks, *inner)

    def describe(self) -> str:
        """Canonical text of everything that decides where a block's bytes come from."""
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"layers={self.num_layers};kv_parts={self.kv_parts};kv_heads={self.num_kv_heads};"
            f"head_size={self.head_size};block_size={self.block_size};dtype={dtype};"
            f"block_dim={self.block_dim}"
        )

    @property
    def signature(self) -> bytes:
        """16-byte digest of ``describe()``; part of the hash namespace and of each disk value."""
        return xxhash.xxh3_128_digest(self.describe().encode())

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Zeroed per-layer KV tensors for ``num_blocks`` blocks."""
        shape = self.layer_shape(num_blocks)
        return [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]

    def check_tensors(self, kv_caches: Sequence[torch.Tensor]) -> int:
        """Validates per-layer tensors against this layout and returns their block count."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layer tensors, got {len(kv_caches)}")
        if kv_caches[0].dim() != 5:
            raise ValueError(
                f"layer tensors must be 5-D {self.layer_shape(-1)}, got {tuple(kv_caches[0].shape)}"
            )
        num_blocks = kv_caches[0].shape[self.block_dim]
        want = self.layer_shape(num_blocks)
        for i, t in enumerate(kv_caches):
            if tuple(t.shape) != want or t.dtype != self.dtype:
                raise ValueError(
                    f"layer {i}: tensor {tuple(t.shape)} {t.dtype} does not match layout "
                    f"{want} {self.dtype}"
                )
        return num_blocks

    def gather(
        self, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Copies blocks ``block_ids`` of every layer into ``out`` (uint8, ``[n, block_bytes]``).

        ``out`` must live on the same device as the caches; one ``index_select`` per layer
        writes straight into its column range of ``out``, so there is no intermediate copy
        beyond the one the indexing itself makes.
        """
        n = block_ids.numel()
        rows = out.view(n, self.num_layers, self.layer_block_bytes)
        for layer, cache in enumerate(kv_caches):
            picked = cache.index_select(self.block_dim, block_ids)
            if self.block_dim != 0:
                picked = picked.movedim(self.block_dim, 0)
            rows[:, layer].copy_(picked.reshape(n, -1).view(torch.uint8))

    def scatter(
        self, src: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor
    ) -> None:
        """Writes ``src`` (uint8, ``[n, block_bytes]``) into blocks ``block_ids`` of every layer."""
        n = block_ids.numel()
        rows = src.view(n, self.num_layers, self.layer_block_bytes)
        inner = self.layer_shape(n)
        if self.block_dim != 0:
            inner = (n, self.kv_parts, *inner[2:])
        for layer, cache in enumerate(kv_caches):
            values = rows[:, layer].contiguous().view(self.dtype).view(inner)
            if self.block_dim != 0:
                values = values.movedim(0, self.block_dim)
            cache.index_copy_(self.block_dim, block_ids, values)
