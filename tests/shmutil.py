"""A tmpfs of a given size, for tests that need an arena directory smaller than /dev/shm."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes of its own, unmounted and removed afterwards; the test is
    skipped where it cannot be mounted (``mount`` needs root, or CAP_SYS_ADMIN)."""
    where = Path(tempfile.mkdtemp(prefix="kvtier-arenas-"))
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs of its own here: {done.stderr.strip()}")
        try:
            yield where
        finally:
            subprocess.run(["umount", "-l", str(where)], check=True)
    finally:
        shutil.rmtree(where, ignore_errors=True)
