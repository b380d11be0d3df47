"""A damaged disk tier directory never crashes the process nor stops it from starting.

Each damaged copy is opened in a child process, so that a fault (SIGBUS from a truncated map)
shows as the child's signal rather than killing the test run. The child reports what it
found: every block it serves must be exact, and a damaged index must have been moved aside.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest
import xxhash

from kvtier.tiers.disk import directory as disk_dir
from kvtier.tiers.disk.directory import CLEAN_FILE, LOCK_FILE, DirectoryInUse
from kvtier.tiers.disk.index import BlockIndex
from kvtier.tiers.disk.tier import DATA_FILE, DiskTier

from diskutil import key

BLOCK = 4096
COUNT = 600
META = 100
ENTRY_BYTES = 50 + META  # an index value: the entry's header, then the meta
PAGE = 4096
SIG = xxhash.xxh3_128_digest(b"layout-damage")


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


def tier(path: Path, **kwargs) -> DiskTier:
    return DiskTier(path, SIG, BLOCK, 2000 * BLOCK, sync=False, **kwargs)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A closed tier of COUNT blocks with meta: an index of a hundred or so LMDB pages."""
    path = tmp_path_factory.mktemp("base") / "tier"
    with tier(path) as t:
        for i in range(COUNT):
            t.put(key(i), block(i), meta=bytes([i % 256]) * META)
            if i % 50 == 0:
                t.flush()
    return path


@pytest.fixture
def copy(base, tmp_path) -> Path:
    path = tmp_path / "tier"
    shutil.copytree(base, path)
    return path


_OPEN = """
import io, json, logging, sys
import numpy as np, xxhash
log = io.StringIO()
logging.basicConfig(stream=log, level=logging.WARNING, format="%(message)s")
from kvtier.tiers.disk.tier import DiskTier
path, sig, size, count = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
key = lambda i: xxhash.xxh3_128_digest(i.to_bytes(8, "little"))
block = lambda i: np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
exact = wrong = 0
with DiskTier(path, sig, size, 2000 * size, sync=False) as t:
    out = np.empty(size, np.uint8)
    for i in range(count):
        if t.get_into(key(i), out):
            exact += np.array_equal(out, block(i))
            wrong += not np.array_equal(out, block(i))
    t.put(key(10**6), block(10**6))
    t.flush()
    works = t.get_into(key(10**6), out) and np.array_equal(out, block(10**6))
    c = t.counters
print(json.dumps(dict(exact=exact, wrong=wrong, works=bool(works), used=c.used_blocks,
                      checksum_failures=c.checksum_failures, log=log.getvalue())))
"""


def open_in_child(path: Path) -> dict:
    """Opens the tier at ``path`` in a child process; returns its report."""
    child = subprocess.run(
        [sys.executable, "-c", _OPEN, str(path), SIG.hex(), str(BLOCK), str(COUNT)],
        capture_output=True,
        timeout=120,
    )
    assert child.returncode == 0, f"child died ({child.returncode}): {child.stderr.decode()}"
    report = json.loads(child.stdout)
    assert report["wrong"] == 0 and report["works"], report
    return report


def moved_aside(path: Path, report: dict) -> Path:
    """The directory the damaged index went to, checked against the log line naming it."""
    [aside] = path.parent.glob(f"{path.name}.damaged-*")
    assert f"moved it aside to {aside}" in report["log"], report["log"]
    assert report["log"].count("moved it aside") == 1, report["log"]
    assert (aside / "data.mdb").exists() and report["exact"] == 0
    assert (path / DATA_FILE).exists() and not (aside / DATA_FILE).exists()  # reused
    return aside


def test_an_intact_copy_opens_with_every_block(copy):
    report = open_in_child(copy)
    assert report["exact"] == COUNT and "damaged" not in report["log"]


def used_bytes(data: bytes) -> int:
    """Where the pages the newest meta page says are in use end."""
    # a meta page: the page header (16 B), then the meta with its last page and txnid at 120 B
    metas = [struct.unpack_from("=QQ", data, p * PAGE + 16 + 120) for p in (0, 1)]
    last_page, _ = max(metas, key=lambda m: m[1])
    return (last_page + 1) * PAGE


@pytest.mark.parametrize(
    "where",
    ["empty", "in-meta-0", "in-meta-1", "after-metas", "mid-btree", "last-page", "last-byte"],
)
def test_truncated_index_is_moved_aside(copy, where):
    data = copy / "data.mdb"
    used = used_bytes(data.read_bytes())
    assert used == data.stat().st_size
    size = {
        "empty": 0,
        "in-meta-0": 100,
        "in-meta-1": PAGE + 100,
        "after-metas": 2 * PAGE,
        "mid-btree": used // 2 + 1234,
        "last-page": used - PAGE,
        "last-byte": used - 1,
    }[where]
    os.truncate(data, size)
    report = open_in_child(copy)
    moved_aside(copy, report)
    assert report["used"] == 1  # started empty, then took the new block


@pytest.mark.parametrize("seed", range(6))
def test_garbage_in_the_index_is_survived(copy, seed):
    """Random garbage: LMDB refuses it (moved aside) or reads past it; never a wrong block."""
    data = copy / "data.mdb"
    raw = bytearray(data.read_bytes())
    rng = random.Random(seed)
    for _ in range(3):
        page = rng.randrange(len(raw) // PAGE) if seed % 2 else rng.randrange(2)
        at = page * PAGE + rng.randrange(PAGE - 64)
        raw[at : at + 64] = rng.randbytes(64)
    data.write_bytes(raw)
    report = open_in_child(copy)
    if "damaged" in report["log"]:
        moved_aside(copy, report)


_WALK = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=8)
with env.begin() as txn:
    for name in (b"index", b"order"):
        for _ in txn.cursor(db=env.open_db(name, txn=txn, create=False)):
            pass
"""


def test_index_that_crashes_lmdb_is_caught_in_a_child(copy):
    """A leaf entry claiming 2 GiB of overflow data: reading it faults (SIGBUS); only the
    child's walk can find that out without dying."""
    data = copy / "data.mdb"
    raw = bytearray(data.read_bytes())
    poisoned = 0
    for page in range(2, len(raw) // PAGE):
        at = page * PAGE
        flags, lower = struct.unpack_from("=HH", raw, at + 10)
        if flags != 0x02:  # leaf pages only
            continue
        for i in range((lower - 16) // 2):
            node = at + struct.unpack_from("=H", raw, at + 16 + 2 * i)[0]
            size_lo, size_hi, node_flags, key_size = struct.unpack_from("=HHHH", raw, node)
            if (size_lo, size_hi, node_flags, key_size) == (ENTRY_BYTES, 0, 0, 16):
                # F_BIGDATA, 2 GiB, its "overflow page" page 2
                struct.pack_into("=HHHH", raw, node, 0, 0x7FFF, 1, 16)
                struct.pack_into("=Q", raw, node + 8 + 16, 2)
                poisoned += 1
    assert poisoned
    data.write_bytes(raw)
    walk = subprocess.run([sys.executable, "-c", _WALK, str(copy)], capture_output=True)
    assert walk.returncode in (-signal.SIGBUS, -signal.SIGSEGV), walk  # the file is lethal
    report = open_in_child(copy)
    moved_aside(copy, report)
    assert "killed a process with SIG" in report["log"]


def test_truncated_or_garbage_data_file_loses_only_what_it_lost(copy):
    stride = BLOCK
    blocks = copy / DATA_FILE
    os.truncate(blocks, 300 * stride)
    report = open_in_child(copy)
    assert "damaged" not in report["log"]
    assert report["exact"] == 300  # blocks took the lowest free slots: the rest were cut off


def test_garbage_data_file_gives_misses_never_wrong_bytes(copy):
    blocks = copy / DATA_FILE
    raw = bytearray(blocks.read_bytes())
    rng = random.Random(7)
    for _ in range(50):
        at = rng.randrange(len(raw) - 16)
        raw[at : at + 16] = rng.randbytes(16)
    blocks.write_bytes(raw)
    report = open_in_child(copy)
    assert report["checksum_failures"] > 0
    assert report["exact"] + report["checksum_failures"] == COUNT


def test_missing_lock_files_lose_nothing(copy):
    (copy / "lock.mdb").unlink()
    (copy / LOCK_FILE).unlink()
    (copy / CLEAN_FILE).unlink()
    report = open_in_child(copy)
    assert report["exact"] == COUNT and "damaged" not in report["log"]


def test_lmdb_error_during_recovery_moves_the_index_aside(copy, monkeypatch, caplog):
    load = BlockIndex.load
    calls = []

    def corrupt_once(self, txn, keep):
        calls.append(1)
        if len(calls) == 1:
            raise lmdb.CorruptedError("mdb_cursor_get: MDB_CORRUPTED")
        return load(self, txn, keep)

    monkeypatch.setattr(BlockIndex, "load", corrupt_once)
    with tier(copy) as t:
        assert len(t) == 0
        t.put(key(1), block(1))
        t.flush()
    [aside] = copy.parent.glob("tier.damaged-*")
    assert f"moved it aside to {aside}" in caplog.text and "CorruptedError" in caplog.text


def test_environment_errors_are_raised_not_taken_for_damage(copy, monkeypatch):
    def refused(self, txn, keep):
        raise lmdb.DiskError("mdb_txn_commit: No space left on device")

    monkeypatch.setattr(BlockIndex, "load", refused)
    with pytest.raises(lmdb.DiskError):
        tier(copy)
    assert not list(copy.parent.glob("tier.damaged-*"))
    monkeypatch.undo()
    with tier(copy) as t:  # and the directory was given back
        assert len(t) == COUNT


def test_walk_runs_after_a_crash_not_after_a_clean_close(copy, monkeypatch):
    walked = []
    verify = disk_dir.verify_in_child

    def counted(path: str) -> str | None:
        walked.append(path)
        return verify(path)

    monkeypatch.setattr(disk_dir, "verify_in_child", counted)
    tier(copy).close()  # a copied file is not the one the note describes
    assert walked == [str(copy)]
    tier(copy).close()
    tier(copy).close()
    assert walked == [str(copy)]
    (copy / CLEAN_FILE).unlink()  # as a crash leaves it
    tier(copy).close()
    assert walked == [str(copy)] * 2
    with open(copy / "data.mdb", "r+b") as f:  # written by something else since
        f.seek(0, os.SEEK_END)
        f.write(bytes(PAGE))
    with tier(copy) as t:
        assert len(t) == COUNT
    assert walked == [str(copy)] * 3


_HOLD = """
import sys
from kvtier.tiers.disk.tier import DiskTier
t = DiskTier(sys.argv[1], bytes(16), 4096, 64 * 4096, sync=False)
print("open", flush=True)
sys.stdin.read()
"""


def test_directory_is_owned_by_one_process(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline() == b"open\n"
        assert (tmp_path / LOCK_FILE).read_text().strip() == str(holder.pid)
        with pytest.raises(DirectoryInUse, match=f"{tmp_path} is in use by process {holder.pid}"):
            DiskTier(tmp_path, bytes(16), 4096, 64 * 4096)
    finally:
        holder.kill()
        holder.wait(30)
    with DiskTier(tmp_path, bytes(16), 4096, 64 * 4096) as t:  # a dead holder holds nothing
        assert (tmp_path / LOCK_FILE).read_text().strip() == str(os.getpid())
        assert len(t) == 0


def test_directory_and_files_are_private(tmp_path):
    old = tmp_path / "old"
    with tier(old) as t:
        t.put(key(0), block(0))
    os.chmod(old, 0o755)  # as an older version left them: readable by everyone
    for p in old.iterdir():
        os.chmod(p, 0o644)
    for path in (tmp_path / "new", old):
        with tier(path) as t:
            t.put(key(1), block(1))
            assert stat.S_IMODE(path.stat().st_mode) == 0o700
            names = {p.name for p in path.iterdir()}
            assert {"data.mdb", "lock.mdb", DATA_FILE, LOCK_FILE} <= names
            for p in path.iterdir():
                assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
        assert np.array_equal(read_back(path, 0), block(0)) or path.name == "new"


def read_back(path: Path, i: int) -> np.ndarray | None:
    out = np.empty(BLOCK, np.uint8)
    with tier(path) as t:
        return out if t.get_into(key(i), out) else None
