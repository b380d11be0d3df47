"""How many blocks a disk tier directory holds, read without opening the tier.

For a layout whose directory lies on disk while no engine uses it: its blocks take room and
serve nobody, and the operator should see how many there are. Opening the tier would recover
it (read every entry, reserve its slot file, start its writer); this reads one number instead,
the entry count LMDB keeps in the ``index`` database's header (O(1), whatever the number of
blocks), under the same guards as opening: the directory is taken (``flock``) for the read,
and ``TierDirectory.check`` runs first, so a damaged index is moved aside (the tier then holds
nothing) and an index not as a clean close left it is walked in a child process before LMDB
maps it here. Nothing is written to the index, so the clean-close note is put back afterwards:
the next count, or the tier's own opening, skips that walk.
"""

from __future__ import annotations

import os

import lmdb

from kvtier.tiers.disk.directory import LMDB_FILE, TierDirectory, is_damage
from kvtier.tiers.disk.index import INDEX_DB


def count_blocks(path: str) -> int:
    """Blocks the index of the disk tier directory at ``path`` names (0 where there is none or
    it was found damaged and moved aside). Raises ``DirectoryInUse`` if another opener holds
    the directory, ``lmdb.Error`` or ``OSError`` if it cannot be read."""
    if not os.path.isdir(path):
        return 0
    directory = TierDirectory(path)
    try:
        directory.check()
        if not os.path.exists(os.path.join(path, LMDB_FILE)):
            return 0
        try:
            count = _entries(path)
        except lmdb.Error as exc:
            if not is_damage(exc):
                raise
            directory.move_aside(f"{type(exc).__name__}: {exc}")
            return 0
        directory.mark_clean()
        return count
    finally:
        directory.release()


def _entries(path: str) -> int:
    # Read-only and without LMDB's lock file: the directory's flock keeps every writer out.
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=4, subdir=True)
    try:
        with env.begin() as txn:
            if txn.get(INDEX_DB) is None:  # a named database is a key of the main one
                return 0
            return txn.stat(env.open_db(INDEX_DB, txn=txn, create=False))["entries"]
    finally:
        env.close()
