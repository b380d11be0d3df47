from __future__ import annotations

import pytest
import torch

from kvtier.tiers.layout import KVLayout, dtype_from_name


@pytest.mark.parametrize("block_dim", [0, 1])
@pytest.mark.parametrize("kv_parts", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gather_scatter_roundtrip(block_dim, kv_parts, dtype):
    layout = KVLayout(3, 2, 8, 4, dtype, kv_parts=kv_parts, block_dim=block_dim)
    src = layout.allocate(7)
    for t in src:
        t.copy_(torch.randn(t.shape).to(dtype))
    ids = torch.tensor([5, 0, 3])
    out = torch.empty((3, layout.block_bytes), dtype=torch.uint8)
    layout.gather(src, ids, out)
    dst = layout.allocate(7)
    layout.scatter(out, dst, torch.tensor([1, 2, 6]))
    for s, d in zip(src, dst, strict=True):
        for a, b in ((5, 1), (0, 2), (3, 6)):
            assert torch.equal(s.select(block_dim, a), d.select(block_dim, b))
    assert torch.count_nonzero(dst[0].select(block_dim, 4)) == 0


def test_block_bytes_are_layer_major_k_then_v():
    layout = KVLayout(2, 1, 1, 2, torch.float32)
    kv = layout.allocate(1)
    kv[0][0].fill_(1.0)  # layer 0 K
    kv[0][1].fill_(2.0)  # layer 0 V
    kv[1][0].fill_(3.0)
    kv[1][1].fill_(4.0)
    out = torch.empty((1, layout.block_bytes), dtype=torch.uint8)
    layout.gather(kv, torch.tensor([0]), out)
    assert out.view(torch.float32).tolist() == [[1, 1, 2, 2, 3, 3, 4, 4]]


def test_signature_and_sizes():
    a = KVLayout(32, 8, 128, 16, torch.float16)
    assert a.block_bytes == 2 * 1024 * 1024
    assert a.signature != KVLayout(32, 8, 128, 16, torch.bfloat16).signature
    assert a.signature != KVLayout(32, 8, 128, 16, torch.float16, block_dim=0).signature
    assert a.signature == KVLayout(32, 8, 128, 16, torch.float16).signature
    assert len(a.signature) == 16


def test_bad_layouts_and_tensors():
    with pytest.raises(ValueError):
        KVLayout(0, 1, 1, 1)
    with pytest.raises(ValueError):
        KVLayout(1, 1, 1, 1, kv_parts=3)
    layout = KVLayout(2, 1, 4, 4)
    with pytest.raises(ValueError):
        layout.check_tensors(layout.allocate(3)[:1])
    with pytest.raises(ValueError):
        layout.check_tensors([torch.zeros(3), torch.zeros(3)])
    with pytest.raises(ValueError):
        dtype_from_name("float64x")
    assert dtype_from_name("torch.bfloat16") is torch.bfloat16
