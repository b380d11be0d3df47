"""Helpers for tests of the disk tier: seeded block names and contents, a tier on a test
directory, and the slots its index names."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import xxhash

from kvtier.tiers.disk.index import parse
from kvtier.tiers.disk.tier import DiskTier

BLOCK = 16 * 1024 + 8
"""Not a whole number of pages, on purpose: written through a staging buffer, never straight."""
SIG = xxhash.xxh3_128_digest(b"layout-a")


def key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def block(i: int, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def tier(path: Path, capacity_blocks: int = 64, **kwargs) -> DiskTier:
    kwargs.setdefault("sync", False)
    return DiskTier(path, SIG, BLOCK, capacity_blocks * BLOCK, **kwargs)


def read(t: DiskTier, i: int) -> np.ndarray | None:
    out = np.empty(BLOCK, np.uint8)
    return out if t.get_into(key(i), out) else None


def used_slots(t: DiskTier) -> set[int]:
    with t._s.index.read() as txn:
        return {parse(bytes(v)).slot for _, v in txn.cursor()}


def run_until_killed(script: str, path: Path, count: int, timeout: float) -> None:
    """Runs ``script`` in a child (argv: the tier's directory, layout signature, block bytes,
    ``count``) that stores ``count`` seeded blocks and ends itself with SIGKILL."""
    child = subprocess.run(
        [sys.executable, "-c", script, str(path), SIG.hex(), str(BLOCK), str(count)],
        capture_output=True,
        timeout=timeout,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()


def assert_holds_exactly(path: Path, count: int) -> None:
    """The tier at ``path``, reopened, holds blocks 0 to ``count - 1`` byte for byte, and no
    others."""
    with tier(path) as t:
        assert len(t) == count
        for i in range(count):
            assert np.array_equal(read(t, i), block(i))
