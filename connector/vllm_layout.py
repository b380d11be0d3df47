"""vLLM's paged KV tensors seen as kvtier ``KVLayout`` tensors.

vLLM hands the connector one view per layer with the logical shape
``[num_blocks, num_kv_heads, block_size, head_size + head_size_v]`` (K and V side by side in
the last axis) over one shared int8 buffer, with strides from the resolved ``KVCacheLayout``.
Splitting the last axis into ``(2, head_size)`` and permuting gives, without a copy, the 5-D
``[num_blocks, 2, block_size, num_kv_heads, head_size]`` view that ``KVLayout(block_dim=0)``
gathers from and scatters into. A block's bytes below the GPU are then kvtier's canonical
order (per layer: K then V, token-major), whatever physical order vLLM chose, so blocks stay
interchangeable between engines whose attention backends differ.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvtier.tiers.layout import KVLayout

REQUIRED_KV_CACHE_LAYOUT = "BLHNC"
"""Block-outermost: every layer of one block is one contiguous run, so a block is read and
written as one region. Backends that cannot use it make vLLM fall back (with a warning);
``layer_views`` accepts every layout."""


def layout_from_kv_cache_config(kv_cache_config) -> tuple[KVLayout, list[str]]:
    """The ``KVLayout`` of one rank's KV cache, and its layer names in layer order.

    Supported: one KV cache group of plain full attention (K and V of the same head size, no
    quantisation scales, no padded pages). Anything else is refused here, at start-up.
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
    if spec.head_size_v != spec.head_size:
        raise ValueError(
            f"KVTierConnector needs K and V of one head size, got {spec.head_size} and "
            f"{spec.head_size_v}"
        )
    if spec.page_size_padded is not None or spec.page_size_bytes != spec.real_page_size_bytes:
        raise ValueError("KVTierConnector does not support padded or quantised KV pages")
    layout = KVLayout(
        num_layers=len(group.layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        block_size=spec.block_size,
        dtype=spec.dtype,
        kv_parts=2,
        block_dim=0,
    )
    return layout, list(group.layer_names)


def layer_views(
    layout: KVLayout, kv_caches: Mapping[str, torch.Tensor], layer_names: list[str]
) -> list[torch.Tensor]:
    """Per-layer ``layout.layer_shape(num_blocks)`` views over vLLM's tensors (no copy)."""
    views: list[torch.Tensor] = []
    heads, block, head = layout.num_kv_heads, layout.block_size, layout.head_size
    for name in layer_names:
        cache = kv_caches[name]
        want = (heads, block, 2 * head)
        if cache.dim() != 4 or tuple(cache.shape[1:]) != want or cache.dtype != layout.dtype:
            raise ValueError(
                f"layer {name}: KV tensor {tuple(cache.shape)} {cache.dtype} is not "
                f"[blocks, {heads}, {block}, {2 * head}] {layout.dtype} (kernel blocks smaller "
                "than the cache block size are not supported yet)"
            )
        if cache.stride(-1) != 1:
            raise ValueError(f"layer {name}: the head axis of the KV tensor must be contiguous")
        # [B, H, N, 2*D] -> [B, H, N, 2, D] -> [B, 2, N, H, D]
        views.append(cache.unflatten(-1, (2, head)).permute(0, 3, 2, 1, 4))
    layout.check_tensors(views)
    return views
