"""``kvtier bench gpu``: a clear refusal without a GPU; a small real run with one."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kvtier.bench.gpu import command as gpu


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
    ]
    assert gpu.run(parse(argv)) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "pcie_h2d_gbps",
        "pcie_d2h_gbps",
        "h2d_ratio",
        "d2h_ratio",
        "ttft_recompute_ms",
        "ttft_host_ms",
        "ttft_disk_ms",
        "zero_reuse_overhead",
        "connector_d2h_gbps",
        "connector_h2d_gbps",
        "connector_d2h_ratio",
        "connector_h2d_ratio",
        "connector_bidir_ratio",
        "connector_lbhnc_d2h_ratio",
        "engine_thread_sync_ms",
        "step_overhead_zero_reuse",
    ):
        assert key in out
    assert out["copy_round_trip_exact"] and out["connector_round_trip_exact"]
    assert out["connector_arena_pinned"]
    assert out["staging_bytes"] == 0  # BLHNC: one DMA per run, no staging
    # the fixed ring and its two id buffers of 48 ids (each rounded up to 512 B by the allocator)
    assert 0 < out["lbhnc_staging_bytes"] <= (128 << 20) + 2 * 512
    assert out["ttft_host_hit_blocks"] == out["ttft_disk_hit_blocks"] == 512 // 16 - 4
