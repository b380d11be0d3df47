"""Shared fixtures and the ``cuda`` marker's skip."""

from __future__ import annotations

import pytest
import torch

from kvtier.tiers.layout import KVLayout


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def small_layout() -> KVLayout:
    """Two layers, 4-token blocks: 512-byte blocks, small enough for thousands of steps."""
    return KVLayout(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype=torch.float16)
