"""vLLM's paged KV cache seen by kvtier: the block layout and where vLLM put its pages.

vLLM allocates one flat buffer and hands the connector one view per layer with the logical
shape ``[num_blocks, num_kv_heads, block_size, head_size + head_size_v]`` (K and V side by
side in the last axis), with strides from the resolved ``KVCacheLayout``. kvtier asks for the
block-outermost ``BLHNC``, whose block is exactly kvtier's canonical block: one contiguous run
that moves as one DMA. A backend that cannot give it (vLLM's CPU backend gives ``LBHNC``)
makes vLLM fall back; ``kv_placement`` describes any order, and the copy engine then gathers
through its fixed staging ring (GPU) or row copies (CPU). Blocks stay interchangeable between
engines whose attention backends differ.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvtier.tiers.kv_placement import KVPlacement
from kvtier.tiers.layout import BLOCK_ORDER, KVLayout

REQUIRED_KV_CACHE_LAYOUT = BLOCK_ORDER
"""Block-outermost: every layer of one block is one contiguous run, so a block is read and
written as one region. Backends that cannot use it make vLLM fall back (with a warning)."""


def layout_from_kv_cache_config(kv_cache_config) -> tuple[KVLayout, list[str]]:
    """The ``KVLayout`` of one rank's KV cache, and its layer names in layer order.

    Supported: one KV cache group of plain full attention (K and V may differ in head size,
    pages may be padded; the bytes move as they are). Anything else is refused here, at
    start-up.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"KVTierConnector supports one KV cache group, this model has {len(groups)} "
            "(hybrid models are not supported yet)"
        )
    group = groups[0]
    spec = group.kv_cache_spec
    kind = type(spec).__name__
    if kind != "FullAttentionSpec" or getattr(spec, "sliding_window", None):
        raise ValueError(f"KVTierConnector supports full attention only, got {kind}")
    packed = getattr(spec, "state_content_bytes", None) is not None or getattr(
        spec, "num_head_slots", None
    ) not in (None, spec.num_kv_heads)
    # 0: plain, 1: FP8 with per-tensor scales (the scales live outside the pages)
    if packed or int(getattr(spec, "kv_quant_mode", 0)) not in (0, 1):
        raise ValueError("KVTierConnector does not support packed or per-token quantised pages")
    layout = KVLayout(
        num_layers=len(group.layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        block_size=spec.block_size,
        dtype=spec.dtype,
        head_size_v=spec.head_size_v,
        page_size_padded=spec.page_size_padded,
    )
    return layout, list(group.layer_names)


def kv_placement(
    layout: KVLayout, kv_caches: Mapping[str, torch.Tensor], layer_names: list[str]
) -> KVPlacement:
    """Where vLLM's per-layer views put ``layout``'s pages (no copy), with a clear error for
    views kvtier cannot address (kernel blocks smaller than the cache block, for one)."""
    missing = [name for name in layer_names if name not in kv_caches]
    if missing:
        raise ValueError(f"vLLM registered no KV tensor for layers {missing[:4]}")
    try:
        return KVPlacement.from_layer_views(layout, [kv_caches[name] for name in layer_names])
    except ValueError as exc:
        raise ValueError(
            f"{exc} (kernel blocks smaller than the cache block size are not supported yet)"
        ) from exc
