"""The canonical block (``KVLayout``) and where engines keep its pages (``KVPlacement``)."""

from __future__ import annotations

import pytest
import torch

from kvtier.tiers.gpu.copy_engine import CopyEngine
from kvtier.tiers.gpu.placement import ORDERS, KVPlacement
from kvtier.tiers.layout import KVLayout, dtype_from_name

LAYOUTS = {
    "gqa": KVLayout(3, 2, 8, 4, torch.float16),
    "k_ne_v": KVLayout(2, 2, 8, 4, torch.bfloat16, head_size_v=4),
    "mla": KVLayout.mla(2, 12, 4, torch.float16),
    "fp8": KVLayout(2, 2, 16, 4, torch.float8_e4m3fn),
    "padded": KVLayout(2, 2, 8, 4, torch.float16, page_size_padded=288),
    "odd": KVLayout(2, 3, 3, 5, torch.uint8),
    "packed": KVLayout(2, 4, 20, 4, torch.int8, head_size_v=0, packing="INT8_PER_TOKEN_HEAD"),
}


def random_fill(placement: KVPlacement, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    placement.buffer.copy_(
        torch.randint(0, 256, placement.buffer.shape, dtype=torch.uint8, generator=gen)
    )


def canonical_block(placement: KVPlacement, block: int) -> bytes:
    """The block's bytes written out from the per-layer views: layer, head, token, K then V."""
    lay = placement.layout
    out = bytearray()
    for view in placement.layer_views():
        page = view[block].contiguous().view(torch.uint8).numpy().tobytes()
        out += page + bytes(lay.page_stride - lay.page_bytes)
    return bytes(out)


def test_block_bytes_and_signature():
    a = KVLayout(32, 8, 128, 16, torch.float16)
    assert a.block_bytes == 2 * 1024 * 1024 and a.row_bytes == 512
    assert len(a.signature) == 16
    assert a.signature == KVLayout(32, 8, 128, 16, torch.float16).signature
    others = [
        KVLayout(32, 8, 128, 16, torch.bfloat16),
        KVLayout(32, 8, 128, 16, torch.float16, head_size_v=64),
        KVLayout(32, 8, 128, 16, torch.float16, page_size_padded=70000),
        KVLayout(32, 8, 128, 16, torch.float8_e4m3fn),
        KVLayout(32, 8, 128, 32, torch.float16),
    ]
    assert len({a.signature, *(o.signature for o in others)}) == 1 + len(others)
    assert "order=BLHNC" in a.describe()
    mla = KVLayout.mla(61, 576, 64, torch.bfloat16)
    assert mla.is_mla and mla.block_bytes == 61 * 64 * 576 * 2
    assert mla.signature != KVLayout(61, 1, 288, 64, torch.bfloat16).signature
    # A packed page's bytes mean what its format says: the format is in the signature.
    packed = KVLayout(32, 16, 136, 16, torch.int8, head_size_v=0, packing="INT8_PER_TOKEN_HEAD")
    assert not packed.is_mla and packed.row_bytes == 136
    same_bytes = KVLayout(32, 16, 136, 16, torch.int8, head_size_v=0, packing="CUSTOM")
    assert packed.signature != same_bytes.signature


def test_bad_layouts():
    with pytest.raises(ValueError):
        KVLayout(0, 1, 1, 1)
    with pytest.raises(ValueError, match="one head"):
        KVLayout(2, 2, 8, 4, head_size_v=0)
    with pytest.raises(ValueError, match="smaller"):
        KVLayout(2, 1, 8, 4, page_size_padded=16)
    with pytest.raises(ValueError, match="opaque"):
        KVLayout(2, 2, 8, 4, packing="NVFP4")
    with pytest.raises(ValueError):
        dtype_from_name("float64x")
    assert dtype_from_name("torch.bfloat16") is torch.bfloat16


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("order", sorted(ORDERS))
def test_gather_scatter_give_the_canonical_block(name, order):
    layout = LAYOUTS[name]
    if layout.page_stride != layout.page_bytes and order in ("LHBNC", "BHLNC"):
        with pytest.raises(ValueError, match="cannot pad"):
            KVPlacement.allocate(layout, 7, order=order)
        return
    src = KVPlacement.allocate(layout, 7, order=order)
    random_fill(src)
    ids = torch.tensor([5, 0, 3])
    rows = torch.zeros((3, layout.block_bytes), dtype=torch.uint8)
    src.gather(ids, rows)
    for i, block in enumerate(ids.tolist()):
        assert rows[i].numpy().tobytes() == canonical_block(src, block)
    dst = KVPlacement.allocate(layout, 7, order="LBHNC")
    dst.scatter(rows, torch.tensor([1, 2, 6]))
    for a, b in ((5, 1), (0, 2), (3, 6)):
        assert canonical_block(dst, b) == canonical_block(src, a)
    assert canonical_block(dst, 4) == bytes(layout.block_bytes)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_blhnc_block_is_one_run_in_canonical_order(name):
    layout = LAYOUTS[name]
    placement = KVPlacement.allocate(layout, 5)
    random_fill(placement, 3)
    assert placement.block_contiguous
    assert placement.block_stride == layout.block_bytes
    for block in range(5):
        start = placement.block_offset(block)
        run = placement.buffer[start : start + layout.block_bytes].numpy().tobytes()
        # padding bytes of a page belong to the run as they are; compare the pages only
        want = canonical_block(placement, block)
        for start in range(0, layout.block_bytes, layout.page_stride):
            page = slice(start, start + layout.page_bytes)
            assert run[page] == want[page]
    for order in set(ORDERS) - {"BLHNC"}:
        if layout.page_stride == layout.page_bytes or order[2:] in ("HNC", "NHC"):
            other = KVPlacement.allocate(layout, 5, order=order)
            one_head = layout.num_kv_heads == 1
            assert other.block_contiguous == (one_head and order in ("BLNHC", "BHLNC"))


def test_placement_from_vllm_like_views_round_trips():
    layout = LAYOUTS["gqa"]
    for order in ORDERS:
        made = KVPlacement.allocate(layout, 6, order=order)
        seen = KVPlacement.from_layer_views(layout, made.layer_views())
        assert (seen.offset, seen.layer_stride, seen.block_stride) == (
            made.offset,
            made.layer_stride,
            made.block_stride,
        )
        assert (seen.head_stride, seen.token_stride) == (made.head_stride, made.token_stride)
        assert seen.buffer.data_ptr() == made.buffer.data_ptr()


def test_placement_refuses_views_it_cannot_address():
    layout = LAYOUTS["gqa"]
    views = KVPlacement.allocate(layout, 6).layer_views()
    with pytest.raises(ValueError, match="layer tensors"):
        KVPlacement.from_layer_views(layout, views[:2])
    with pytest.raises(ValueError, match="share one backing buffer"):
        KVPlacement.from_layer_views(layout, [*views[:2], views[2].clone()])
    with pytest.raises(ValueError, match="is not"):
        KVPlacement.from_layer_views(layout, [v.float() for v in views])
    with pytest.raises(ValueError, match="reaches byte"):
        KVPlacement(layout, torch.zeros(100, dtype=torch.uint8), 6, 0, 1000, 1, 1, 1)


def kernel_split(layout: KVLayout, blocks: int, kernel_tokens: int, order: str):
    """vLLM's per-layer views of ``blocks`` cache blocks split into kernel blocks of
    ``kernel_tokens`` tokens (``[blocks * k, H, kernel_tokens, C]``), randomly filled."""
    kernel_layout = KVLayout(
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_size,
        kernel_tokens,
        layout.dtype,
        head_size_v=layout.head_size_v,
    )
    made = KVPlacement.allocate(
        kernel_layout, blocks * (layout.block_size // kernel_tokens), order=order
    )
    random_fill(made, 7)
    return made.layer_views()


def split_block(layout: KVLayout, views: list[torch.Tensor], block: int) -> bytes:
    """The canonical bytes of cache block ``block`` read from kernel-block views."""
    k = layout.block_size // views[0].shape[2]
    out = bytearray()
    for view in views:
        page = torch.cat(list(view[block * k : (block + 1) * k]), dim=1)  # [H, N, C]
        out += page.contiguous().view(torch.uint8).numpy().tobytes()
    return bytes(out)


@pytest.mark.parametrize("name", ["gqa", "k_ne_v", "mla", "fp8"])
@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "BLHNC"])
def test_kernel_blocks_smaller_than_the_block_move_as_the_canonical_block(name, order):
    layout = LAYOUTS[name]  # blocks of 4 tokens, read by kernels of 2 (and 1)
    for kernel_tokens in (2, 1):
        views = kernel_split(layout, 6, kernel_tokens, order)
        placement = KVPlacement.from_layer_views(layout, views)
        assert placement.num_blocks == 6
        assert placement.kernel_blocks == layout.block_size // kernel_tokens
        rows = torch.zeros((2, layout.block_bytes), dtype=torch.uint8)
        placement.gather(torch.tensor([4, 1]), rows)
        assert rows[0].numpy().tobytes() == split_block(layout, views, 4)
        assert rows[1].numpy().tobytes() == split_block(layout, views, 1)
        # Into an engine whose kernel reads whole blocks, and back into a split one.
        whole = KVPlacement.allocate(layout, 6)
        whole.scatter(rows, torch.tensor([0, 5]))
        assert canonical_block(whole, 0) == split_block(layout, views, 4)
        other_views = kernel_split(layout, 6, kernel_tokens, order)
        other = KVPlacement.from_layer_views(layout, other_views)
        other.scatter(rows, torch.tensor([2, 3]))
        assert split_block(layout, other_views, 2) == split_block(layout, views, 4)
        # Row copies (the CPU copy engine's path for a non-canonical order) agree.
        slab = torch.zeros((4, layout.block_bytes), dtype=torch.uint8)
        engine = CopyEngine(placement, slab)
        engine.store([1, 4], [3, 0])
        assert slab[3].numpy().tobytes() == split_block(layout, views, 1)
        assert slab[0].numpy().tobytes() == split_block(layout, views, 4)
        engine.load([0], [5])
        assert split_block(layout, views, 5) == split_block(layout, views, 4)
