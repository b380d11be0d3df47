"""``count_blocks``: a disk tier directory's block count read without opening the tier, under
the guards of opening it (one owner, damage moved aside, an index not closed cleanly walked
first), leaving the index as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.tiers.disk.census import count_blocks
from kvtier.tiers.disk.directory import CLEAN_FILE, LMDB_FILE, DirectoryInUse, TierDirectory

from diskutil import assert_holds_exactly, block, key, tier

COUNT = 12


def filled(path: Path, count: int = COUNT) -> Path:
    with tier(path) as t:
        for i in range(count):
            t.put(key(i), block(i))
    return path


def test_counts_a_closed_tier_and_changes_nothing(tmp_path: Path):
    path = filled(tmp_path / "t")
    data = path / LMDB_FILE
    before = data.stat()
    assert count_blocks(str(path)) == COUNT
    after = data.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    )
    assert (path / CLEAN_FILE).exists()  # the tier's next opening skips its walk
    assert count_blocks(str(path)) == COUNT
    assert_holds_exactly(path, COUNT)


def test_counts_an_index_left_by_a_crash(tmp_path: Path):
    path = filled(tmp_path / "t")
    (path / CLEAN_FILE).unlink()  # as a SIGKILL leaves it: walked in a child before the read
    assert count_blocks(str(path)) == COUNT
    assert_holds_exactly(path, COUNT)


def test_a_damaged_index_is_moved_aside_and_counts_nothing(tmp_path: Path):
    path = filled(tmp_path / "t")
    data = path / LMDB_FILE
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    assert count_blocks(str(path)) == 0
    assert [p.name for p in tmp_path.iterdir() if ".damaged-" in p.name]


def test_no_directory_counts_nothing_and_makes_none(tmp_path: Path):
    assert count_blocks(str(tmp_path / "none")) == 0
    assert not (tmp_path / "none").exists()


def test_a_directory_in_use_is_not_read(tmp_path: Path):
    path = filled(tmp_path / "t")
    held = TierDirectory(str(path))
    try:
        with pytest.raises(DirectoryInUse):
            count_blocks(str(path))
    finally:
        held.release()
