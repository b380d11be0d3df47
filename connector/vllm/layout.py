"""vLLM's paged KV cache seen by kvtier: a group's block layout and where vLLM put its pages.

vLLM allocates one flat buffer and hands the connector one view per layer with the logical
shape ``[num_blocks, num_heads, block_size, C]`` (for attention K and V side by side in
``C``; for MLA one latent; for a packed quantised page each head slot's opaque bytes), with
strides from the resolved ``KVCacheLayout``. kvtier asks for the block-outermost ``BLHNC``,
whose block is exactly kvtier's canonical block: one contiguous run that moves as one DMA. A
backend that cannot give it (vLLM's CPU backend gives ``LBHNC``) makes vLLM fall back;
``tiers.gpu.placement`` describes any order, kernel blocks smaller than the cache block included,
and the copy engine then gathers through its fixed staging ring (GPU) or row copies (CPU).
Blocks stay interchangeable between engines whose attention backends differ.

The bytes of a page move as they are, so FP8 and packed quantised pages (vLLM's
per-token-head and FP4 modes pack their scales into each slot) need nothing special; the
dtype, the packing and any page padding are part of the layout signature.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvtier.tiers.gpu.placement import KVPlacement
from kvtier.tiers.layout import BLOCK_ORDER, KVLayout

REQUIRED_KV_CACHE_LAYOUT = BLOCK_ORDER
"""Block-outermost: every layer of one block is one contiguous run, so a block is read and
written as one region. Backends that cannot use it make vLLM fall back (with a warning)."""

_PER_TENSOR_SCALES = (0, 1)
"""vLLM's ``KVQuantMode`` NONE and FP8_PER_TENSOR: plain pages. FP8's per-tensor scales are
the layer's (from the checkpoint), not in the page: engines serving one ``model_id`` share
them."""


def layout_of_spec(spec, num_layers: int) -> KVLayout:
    """The ``KVLayout`` of ``num_layers`` layers of one attention spec, or a ``ValueError``."""
    tokens_per_state = getattr(spec, "tokens_per_state", 1)
    if tokens_per_state != 1:
        raise ValueError(
            f"a page state covers {tokens_per_state} tokens; kvtier stores one per token"
        )
    mode = int(getattr(spec, "kv_quant_mode", 0))
    content = getattr(spec, "state_content_bytes", None)
    slots = getattr(spec, "num_head_slots", None)
    if content is None and slots in (None, spec.num_kv_heads):
        if mode not in _PER_TENSOR_SCALES:
            raise ValueError(
                f"KV quantisation mode {_mode_name(spec)} keeps its scales outside the page"
            )
        return KVLayout(
            num_layers=num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            block_size=spec.block_size,
            dtype=spec.dtype,
            head_size_v=spec.head_size_v,
            page_size_padded=spec.page_size_padded,
        )
    # A packed page: [slots, tokens, content bytes] of a format the quantisation mode names.
    elem = torch.empty((), dtype=spec.dtype).element_size()
    content = content if content is not None else spec.state_content_size_bytes
    if content % elem:
        raise ValueError(f"a packed slot of {content} B is not whole {spec.dtype} elements")
    return KVLayout(
        num_layers=num_layers,
        num_kv_heads=spec.num_heads,
        head_size=content // elem,
        block_size=spec.block_size,
        dtype=spec.dtype,
        head_size_v=0,
        page_size_padded=spec.page_size_padded,
        packing=_mode_name(spec),
    )


def kv_placement(
    layout: KVLayout, kv_caches: Mapping[str, torch.Tensor], layer_names: list[str]
) -> KVPlacement:
    """Where vLLM's per-layer views put ``layout``'s pages (no copy), with a clear error for
    views kvtier cannot address."""
    missing = [name for name in layer_names if name not in kv_caches]
    if missing:
        raise ValueError(f"vLLM registered no KV tensor for layers {missing[:4]}")
    return KVPlacement.from_layer_views(layout, [kv_caches[name] for name in layer_names])


def _mode_name(spec) -> str:
    mode = getattr(spec, "kv_quant_mode", 0)
    return getattr(mode, "name", str(mode))
