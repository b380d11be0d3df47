from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvtier.tiers.buffers import copy_bytes


def test_copy_bytes_copies_between_the_buffers_the_tiers_hold():
    data = np.random.default_rng(0).integers(0, 256, 3 * 4096, np.uint8)
    pooled = mmap.mmap(-1, len(data))
    copy_bytes(memoryview(pooled), memoryview(data).cast("B"))
    assert bytes(pooled) == data.tobytes()
    out = bytearray(4096)
    copy_bytes(out, memoryview(pooled)[4096:8192])
    assert out == data[4096:8192].tobytes()
    pooled.close()


def test_copy_bytes_refuses_buffers_of_other_sizes_or_read_only():
    with pytest.raises(ValueError):
        copy_bytes(bytearray(8), bytes(16))
    with pytest.raises(ValueError):
        copy_bytes(bytes(8), bytes(8))
