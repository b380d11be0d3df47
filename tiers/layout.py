"""What one KV block is, byte for byte, below the GPU: the canonical block of one layout.

Below the GPU a block is ONE contiguous byte string: one block of the engine's block-outermost
KV layout (vLLM's ``BLHNC``), i.e. ``[layer][head][token][C]`` where ``C`` is the token's K
(``head_size`` elements) followed by its V (``head_size_v`` elements) for that head. An MLA
layout has one "head" and ``C`` is the latent (``head_size_v == 0``, no K/V split). Each
layer's page may be padded to ``page_size_padded`` bytes (vLLM pads some pages); the padding
is part of the block. Bytes move as bytes, so FP8 and other 1-byte dtypes need nothing special.
A packed page (a quantisation that packs its data and scales into each slot, as vLLM's
per-token-head and FP4 modes do) is described the same way, its ``C`` opaque bytes of the
format named by ``packing``.

A block of this order is one contiguous run in a ``BLHNC`` KV buffer and moves as one DMA.
Where the engine's tensors sit in memory (that order or another) is ``KVPlacement``'s business
(``kvtier.tiers.gpu.placement``). ``signature`` names everything above, so bytes stored for one
layout can never be loaded into another. A model with several KV cache groups has one layout
per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

BLOCK_ORDER = "BLHNC"
"""The canonical block byte order, named as vLLM names KV cache layouts."""

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
    """One KV cache group's block: ``num_layers`` pages of ``[num_kv_heads, block_size, C]``.

    ``head_size_v`` defaults to ``head_size``; 0 means one part (an MLA latent of
    ``head_size`` elements, with ``num_kv_heads == 1``). ``page_size_padded`` is the byte size
    of one layer's page when the engine pads it beyond ``page_bytes``. ``packing`` names the
    format of a packed page, whose ``num_kv_heads`` slots per token each hold ``head_size``
    elements of that format (``head_size_v`` 0).
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype = torch.float16
    head_size_v: int | None = None
    page_size_padded: int | None = None
    packing: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        if self.head_size_v < 0:
            raise ValueError(f"KVLayout.head_size_v must be >= 0, got {self.head_size_v}")
        if self.packing is not None and self.head_size_v != 0:
            raise ValueError("a packed layout has one opaque part per slot (head_size_v=0)")
        if self.is_mla and self.num_kv_heads != 1:
            raise ValueError(f"an MLA layout (head_size_v=0) has one head, got {self.num_kv_heads}")
        if self.page_size_padded is not None and self.page_size_padded < self.page_bytes:
            raise ValueError(
                f"page_size_padded {self.page_size_padded} is smaller than a page of "
                f"{self.page_bytes} bytes"
            )

    @classmethod
    def mla(
        cls, num_layers: int, latent_size: int, block_size: int, dtype: torch.dtype, **kw
    ) -> KVLayout:
        """An MLA layout: one latent of ``latent_size`` elements per token and layer."""
        return cls(num_layers, 1, latent_size, block_size, dtype, head_size_v=0, **kw)

    @property
    def is_mla(self) -> bool:
        return self.head_size_v == 0 and self.packing is None

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def row_bytes(self) -> int:
        """``C`` in bytes: one token's K and V (or latent) for one head."""
        return (self.head_size + self.head_size_v) * self.elem_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer of one block without padding: ``[heads, tokens, C]``."""
        return self.num_kv_heads * self.block_size * self.row_bytes

    @property
    def page_stride(self) -> int:
        """Bytes of one layer of one block with its padding."""
        return self.page_size_padded or self.page_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole block: every layer's (padded) page, layer after layer."""
        return self.num_layers * self.page_stride

    def describe(self) -> str:
        """Canonical text of everything that decides what a block's bytes mean."""
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"order={BLOCK_ORDER};layers={self.num_layers};heads={self.num_kv_heads};"
            f"tokens={self.block_size};k={self.head_size};v={self.head_size_v};dtype={dtype};"
            f"page={self.page_stride}" + (f";packing={self.packing}" if self.packing else "")
        )

    @property
    def signature(self) -> bytes:
        """16-byte digest of ``describe()``; part of the hash namespace and of each disk value."""
        return xxhash.xxh3_128_digest(self.describe().encode())

    def block_view(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 ``[n, block_bytes]`` rows seen as ``[n, layers, heads, tokens, C]`` of dtype.

        Only for unpadded layouts (padding has no element view); used to read blocks back.
        """
        if self.page_size_padded not in (None, self.page_bytes):
            raise ValueError("a padded layout has no element view of its blocks")
        c = self.head_size + self.head_size_v
        shape = (rows.shape[0], self.num_layers, self.num_kv_heads, self.block_size, c)
        return rows.view(self.dtype).view(shape)
