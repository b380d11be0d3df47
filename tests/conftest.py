"""Shared fixtures, the ``cuda`` marker's skip, and a check that the session leaves nothing
behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from kvtier.connector.client.index_reader import load_probe
from kvtier.tiers.layout import KVLayout

from daemonutil import leftovers

# vLLM puts the ZMQ sockets of every engine it starts in VLLM_RPC_BASE_PATH (the temp
# directory by default) and never removes them: this session's go into a directory of its own.
VLLM_SOCKETS = Path(tempfile.mkdtemp(prefix="kvtier-vllm-ipc-"))
os.environ.setdefault("VLLM_RPC_BASE_PATH", str(VLLM_SOCKETS))


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


@pytest.fixture(scope="session", autouse=True)
def compiled_probe() -> None:
    """Loads the lookup index's compiled probe before any test: a client loads it on a thread
    of its own and answers lookups by call until then, which would make a test's first
    lookups calls or probes by the luck of timing."""
    assert load_probe(), "no compiled probe of the lookup index"


@pytest.fixture(scope="session", autouse=True)
def leaves_nothing_behind():
    """After the last test: no arena in ``/dev/shm``, no directory in ``/tmp``, no process of
    any daemon this session started (what is found is removed, then reported)."""
    yield
    shutil.rmtree(VLLM_SOCKETS, ignore_errors=True)
    found = leftovers()
    assert not found, f"the tests left behind: {found}"
