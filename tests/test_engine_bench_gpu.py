"""``kvtier bench gpu``: a clear refusal without a GPU; a small real run with one."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kvtier.bench.gpu import command as gpu
from kvtier.bench.gpu.e2e import end_to_end
from kvtier.tiers.layout import KVLayout


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gpu.add_arguments(parser)
    return parser.parse_args(argv)


def test_reports_no_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.run(parse(["--json"])) == gpu.NO_GPU_EXIT
    captured = capsys.readouterr()
    assert "no CUDA GPU" in captured.err
    assert captured.out == ""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_small_run_on_gpu(capsys):
    argv = [
        "--json",
        "--pcie-mib",
        "64",
        "--copy-blocks",
        "16",
        "--iters",
        "2",
        "--model",
        "tiny",
        "--prompt-tokens",
        "512",
        "--chunk-tokens",
        "64",
        "--overhead-requests",
        "2",
        "--overhead-prompt-tokens",
        "256",
        "--overhead-decode-steps",
        "4",
        "--connector-blocks",
        "48",
        "--connector-batch",
        "16",
        "--steps",
        "4",
        "--step-blocks",
        "4",
        "--e2e-blocks",
        "4",
        "--e2e-requests",
        "2",
        "--e2e-small-loads",
        "3",
    ]
    assert gpu.run(parse(argv)) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "pcie_h2d_gbps",
        "pcie_d2h_gbps",
        "pool_h2d_ratio",
        "pool_d2h_ratio",
        "ttft_recompute_ms",
        "ttft_host_ms",
        "ttft_disk_ms",
        "zero_reuse_overhead",
        "copy_d2h_gbps",
        "copy_h2d_gbps",
        "copy_d2h_ratio",
        "copy_h2d_ratio",
        "copy_bidir_ratio",
        "copy_lbhnc_d2h_ratio",
        "e2e_store_ratio_4",
        "e2e_load_ratio_4",
        "e2e_load4_ms",
        "e2e_load4_lookup_ms",
        "e2e_load4_acquire_ms",
        "e2e_load4_copy_ms",
        "engine_thread_sync_ms",
        "step_overhead_zero_reuse",
    ):
        assert key in out
    assert out["pool_round_trip_exact"] and out["copy_round_trip_exact"]
    assert out["e2e_round_trip_exact"]
    assert out["copy_arena_pinned"]
    assert out["staging_bytes"] == 0  # BLHNC: one DMA per run, no staging
    # the fixed ring and its two id buffers of 48 ids (each rounded up to 512 B by the allocator)
    assert 0 < out["lbhnc_staging_bytes"] <= (128 << 20) + 2 * 512
    assert out["ttft_host_hit_blocks"] == out["ttft_disk_hit_blocks"] == 512 // 16 - 4


def test_end_to_end_rows_run_the_connector_sequence_through_a_real_daemon_on_cpu():
    """The ``e2e_*`` rows' clients store and load through a real daemon; every block comes
    back whole (on a CPU the copies are synchronous, so only the bytes are checked here)."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, block_size=16)
    run = end_to_end(layout, blocks=4, requests=2, small_loads=2, device="cpu")
    assert run.exact
    assert run.store_gbps > 0 and run.load_gbps > 0 and run.load4_ms > 0
    assert all(ms > 0 for ms in run.load4_parts_ms)
