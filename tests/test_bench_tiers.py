from __future__ import annotations

import json
import sys

from kvtier.bench import tiers
from kvtier.bench.limits import disk_writing
from kvtier.service.cli import main
from kvtier.tiers.tunables import TUNABLES

from daemonutil import wait_until

KEYS = {
    "memcpy_gbps",
    "disk_raw_write_gbps",
    "disk_raw_read_gbps",
    "host_store_gbps",
    "host_load_gbps",
    "disk_write_gbps",
    "disk_write_behind_gbps",
    "disk_read_cold_gbps",
    "hash_mtokens_per_s",
    "host_ratio",
    "disk_write_ratio",
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
    assert seen == [TUNABLES.switch_interval_s] != [own]
    assert sys.getswitchinterval() == own
