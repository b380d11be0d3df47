from __future__ import annotations

import ctypes
import json
import os
import sys

import torch

from kvtier.bench import tiers
from kvtier.bench.limits import disk_writing, raw_disk_gbps
from kvtier.service.cli import main
from kvtier.tiers.tunables import TUNABLES

from daemonutil import wait_until

KEYS = {
    "memcpy_gbps",
    "disk_raw_write_gbps",
    "disk_raw_read_gbps",
    "disk_raw_read_fresh_gbps",
    "host_store_gbps",
    "host_load_gbps",
    "disk_write_gbps",
    "disk_write_first_gbps",
    "disk_write_behind_gbps",
    "disk_read_cold_gbps",
    "hash_mtokens_per_s",
    "host_ratio",
    "disk_write_ratio",
    "disk_write_first_ratio",
    "disk_write_behind_ratio",
    "disk_read_ratio",
}


def test_bench_tiers_json_has_exactly_its_keys(tmp_path, capsys):
    assert main(["bench", "tiers", "--blocks", "4", "--dir", str(tmp_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == KEYS
    assert all(value > 0 for value in result.values())
    assert list(tmp_path.iterdir()) == []  # its scratch directory is gone


def test_disk_writing_keeps_the_disk_busy_and_leaves_nothing_behind(tmp_path):
    probe = tmp_path / "kvtier-busy-probe"
    with disk_writing(str(tmp_path), span=4 << 20):
        wait_until(lambda: probe.exists() and probe.stat().st_size == 4 << 20, "the writes")
    assert list(tmp_path.iterdir()) == []


def test_bench_tiers_runs_the_tiers_under_the_daemons_switch_interval(tmp_path, monkeypatch):
    """The daemon runs its tiers with a 0.5 ms GIL switch interval; measured under Python's
    default 5 ms, the disk tier's threads wait for the GIL and its write ratio fell to 0.36."""
    seen = []
    real = tiers.disk_rates

    def disk_rates(directory, blocks):
        seen.append(sys.getswitchinterval())
        return real(directory, blocks)

    monkeypatch.setattr(tiers, "disk_rates", disk_rates)
    own = sys.getswitchinterval()
    tiers.measure(2, str(tmp_path))
    assert seen == [TUNABLES.switch_interval_s] * tiers.DISK_ROUNDS
    assert own != TUNABLES.switch_interval_s
    assert sys.getswitchinterval() == own


def test_each_disk_round_sets_the_tier_against_the_raw_disk_just_before_and_after(
    tmp_path, monkeypatch
):
    """The virtual disk drifts between one second and the next: a round's write ratios are
    to the mean of the raw writes measured around its tier run, its read ratio to the raw
    read of the tier's own slots in that run, and each figure is the median of the rounds,
    not one run set against another measured earlier."""
    order = []
    raws = iter([(1.0, 4.0), (3.0, 2.0), (2.0, 1.0), (2.0, 1.0), (3.0, 3.0), (5.0, 1.0)])
    tier_rates = iter([(0.5, 1.0, 1.5, 3.0), (1.0, 1.5, 0.75, 1.0), (1.6, 3.6, 1.0, 2.0)])

    def raw(directory, num_bytes):
        order.append("raw")
        return (*next(raws), "O_DIRECT")

    def disk(directory, blocks):
        order.append("tier")
        os.makedirs(directory)  # as the tier's own directory is made
        return next(tier_rates)

    monkeypatch.setattr(tiers, "raw_disk_gbps", raw)
    monkeypatch.setattr(tiers, "disk_rates", disk)
    monkeypatch.setattr(tiers, "write_behind_rate", lambda directory, blocks: 1.0)
    figures = tiers.disk_figures(str(tmp_path), torch.zeros(2, 8, dtype=torch.uint8))
    assert order == ["raw", "tier", "raw"] * 3
    assert list(tmp_path.iterdir()) == []  # each round's scratch directory is gone
    # the rounds' write limits 2, 2, 4; their own files' reads 3, 1, 2
    assert figures["disk_raw_write_gbps"] == 2.0
    assert figures["disk_raw_read_gbps"] == 2.0  # the tier's slots read raw: 3, 1, 2
    assert figures["disk_raw_read_fresh_gbps"] == 2.0
    assert figures["disk_write_gbps"] == 1.5
    assert figures["disk_write_ratio"] == 0.75  # median of 1/2, 1.5/2, 3.6/4
    assert figures["disk_write_first_ratio"] == 0.4  # median of 0.5/2, 1/2, 1.6/4
    assert figures["disk_read_ratio"] == 0.5  # median of 1.5/3, 0.75/1, 1/2
    assert figures["disk_write_behind_ratio"] == 0.5  # median of 1/2, 1/2, 1/4


def test_the_cold_reads_limit_reads_the_tiers_own_slots_into_the_same_memory(tmp_path, monkeypatch):
    """A raw file written just before its read ran at up to 2.9 GB/s on the VM where the
    tier's data file, read by the same loop into the same rows, ran at 1.0 to 1.7: the cold
    read's limit is a raw read of the tier's own slots, into the rows it read them into."""
    read_into, raw_into = [], []
    real_get, real_read = tiers.DiskTier.get_into, tiers.read_slots

    def get_into(self, block_hash, out):
        read_into.append(out.ctypes.data)
        return real_get(self, block_hash, out)

    def read_slots(path, rows, stride):
        raw_into.extend(row.ctypes.data for row in rows)
        assert os.path.basename(path) == tiers.DATA_FILE
        return real_read(path, rows, stride)

    monkeypatch.setattr(tiers.DiskTier, "get_into", get_into)
    monkeypatch.setattr(tiers, "read_slots", read_slots)
    blocks = torch.randint(0, 256, (4, 1 << 16), dtype=torch.uint8)
    rates = tiers.disk_rates(str(tmp_path / "tier"), blocks)
    assert len(rates) == 4 and min(rates) > 0
    assert raw_into == read_into and len(set(read_into)) == 4


def test_the_raw_disk_limit_moves_each_chunk_through_memory_of_its_own(tmp_path, monkeypatch):
    """A tier moves each block between the device and memory of its own; the same reads into
    one reused buffer ran a third faster on the VM's virtual disk than into distinct ones,
    a limit no tier could reach."""
    written, read, runs = [], [], []
    real_writev, real_preadv = os.writev, os.preadv

    def writev(fd, buffers):
        written.extend(ctypes.addressof(ctypes.c_char.from_buffer(data)) for data in buffers)
        runs.append(len(buffers))
        return real_writev(fd, buffers)

    def preadv(fd, buffers, offset):
        read.append(ctypes.addressof(ctypes.c_char.from_buffer(buffers[0])))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "writev", writev)
    monkeypatch.setattr(os, "preadv", preadv)
    write_gbps, read_gbps, _ = raw_disk_gbps(str(tmp_path), 4 << 16, chunk=1 << 16)
    assert write_gbps > 0 and read_gbps > 0
    assert len(set(written)) == len(written) == 4
    assert runs == [4]  # one write of the tier's size (as large as 4 chunks and more)
    assert read == written
    assert list(tmp_path.iterdir()) == []


def test_cold_reads_land_in_memory_holding_bytes_as_the_raw_limits_memory_does(
    tmp_path, monkeypatch
):
    """The raw limit reads into memory filled with random bytes. The cold reads went into
    zeroed memory, which the VM's host had merged into shared pages: each page the disk then
    wrote into was copied apart first, and the reads ran at half the raw speed."""
    zeroed_before_read = []
    real = tiers.DiskTier.get_into

    def get_into(self, block_hash, out):
        zeroed_before_read.append(not bytes(memoryview(out).cast("B")).strip(b"\0"))
        return real(self, block_hash, out)

    monkeypatch.setattr(tiers.DiskTier, "get_into", get_into)
    blocks = torch.randint(0, 256, (4, 1 << 16), dtype=torch.uint8)
    assert min(tiers.disk_rates(str(tmp_path / "tier"), blocks)) > 0
    assert zeroed_before_read == [False] * 4
