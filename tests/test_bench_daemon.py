"""``kvtier bench daemon`` end to end at ``--quick`` sizes: its paced clients and its keys."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from kvtier.bench.daemon import slot_ops
from kvtier.service.cli import main

MIX_KEYS = (
    "lookup_p50_us",
    "lookup_p99_us",
    "slot_op_p50_us",
    "slot_op_p99_us",
    "store_control_us",
    "store_control_by_hash_us",
    "block_ops_per_s",
    "mix_requests_per_s",
    "round_trip_hot_us",
    "round_trip_idle_us",
    "index_probe_hot_us",
    "index_probe_idle_us",
    "daemon_reserve_us_per_block",
    "daemon_commit_us_per_block",
    "daemon_acquire_us_per_block",
    "daemon_release_us_per_block",
    "daemon_notice_hot_us",
    "daemon_notice_idle_us",
    "daemon_notice_fresh_hot_us",
    "daemon_notice_fresh_idle_us",
)


def test_bench_daemon_paced_clients_report_the_control_plane_keys(capsys):
    assert main(["bench", "daemon", "--quick", "--clients", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["clients"] == 2
    for key in MIX_KEYS:
        assert math.isfinite(result[key]) and result[key] > 0, (key, result[key])
    assert result["lookup_p99_us"] >= result["lookup_p50_us"]
    assert result["slot_op_p99_us"] >= result["slot_op_p50_us"]
    assert 0 <= result["mix_late_fraction"] <= 1
    # the keys measured before the paced clients are still there
    assert result["lookup_p50_ms"] > 0 and result["store_ratio"] > 0


def test_the_slot_ops_bench_times_each_way_and_each_uses_its_own():
    """Unary, the gRPC stream and the slot channel each report every figure; ``measure``
    raises if the stream or channel client went another way."""
    # a short root: the daemon's socket path and its relay's addresses must fit 107 bytes
    with tempfile.TemporaryDirectory(prefix="kvb-", dir="/tmp") as root:
        figures = slot_ops.measure(rounds=20, threads=2, root=Path(root))
    for way in slot_ops.WAYS:
        for figure in ("reserve_commit_p50_us", "acquire_release_p99_us", "ops_per_s"):
            assert math.isfinite(figures[f"{way}_{figure}"]) and figures[f"{way}_{figure}"] > 0
