"""Trace replay: hand-computed hits on tiny traces, the baselines' order, the command's output."""

from __future__ import annotations

import argparse
import json

import pytest

from kvtier.bench.replay import command as replay_cmd
from kvtier.bench.replay.sim import (
    REPLAY_LAYOUT,
    Capacity,
    oracle_saved_tokens,
    replay,
)
from kvtier.bench.replay.trace import TraceHasher, TraceRequest, load_trace, write_trace
from kvtier.bench.replay.workloads import WORKLOADS
from kvtier.tiers.hashing import Namespace

BS = 512
BLOCK_BYTES = REPLAY_LAYOUT.block_bytes
PROMPT = 3 * BS + 10  # three full blocks and a partial one; four blocks with one output token


def request(t_s: float, ids: list[int]) -> TraceRequest:
    return TraceRequest(t_s * 1000, PROMPT, 1, (*ids, 1000 + len(ids) + int(t_s)))


def hashed(requests: list[TraceRequest]) -> list[list[bytes]]:
    hasher = TraceHasher(Namespace("test", REPLAY_LAYOUT.signature))
    return [hasher.hashes(r) for r in requests]


def test_gpu_hit_of_shared_prefix():
    reqs = [request(0, [0, 1, 2]), request(1, [0, 1, 3])]
    result = replay(reqs, hashed(reqs), Capacity(gpu_blocks=8))
    assert (result.gpu_hit_tokens, result.host_hit_tokens, result.disk_hit_tokens) == (2 * BS, 0, 0)
    assert result.prompt_tokens == 2 * PROMPT


def test_host_hit_after_gpu_recycles():
    # GPU holds one request (4 blocks): the second recycles the first's blocks into the host.
    reqs = [request(0, [0, 1, 2]), request(1, [5, 6, 7]), request(2, [0, 1, 2])]
    hashes = hashed(reqs)
    tiered = replay(reqs, hashes, Capacity(4, host_bytes=8 * BLOCK_BYTES))
    gpu_only = replay(reqs, hashes, Capacity(4))
    assert (tiered.gpu_hit_tokens, tiered.host_hit_tokens, tiered.disk_hit_tokens) == (0, 3 * BS, 0)
    assert gpu_only.saved_tokens == 0
    assert oracle_saved_tokens(reqs, hashes) == 3 * BS
    assert tiered.corrupt_blocks == 0


def test_disk_hit_after_host_spills():
    # Host holds three blocks: the third request's spill pushes the first's blocks to disk.
    reqs = [
        request(0, [0, 1, 2]),
        request(1, [5, 6, 7]),
        request(2, [8, 9, 10]),
        request(3, [0, 1, 2]),
    ]
    cap = Capacity(4, host_bytes=3 * BLOCK_BYTES, disk_bytes=100 * BLOCK_BYTES)
    result = replay(reqs, hashed(reqs), cap)
    assert (result.gpu_hit_tokens, result.host_hit_tokens, result.disk_hit_tokens) == (0, 0, 3 * BS)
    assert result.blocks_spilled_to_disk >= 3
    assert result.corrupt_blocks == 0


def test_last_token_never_claimed():
    # A prompt of exactly three blocks may take only two: the last token needs a forward pass.
    full = TraceRequest(0, 3 * BS, 1, (0, 1, 2))
    reqs = [full, TraceRequest(1000, 3 * BS, 1, (0, 1, 2))]
    hashes = hashed(reqs)
    assert replay(reqs, hashes, Capacity(8)).gpu_hit_tokens == 2 * BS
    assert oracle_saved_tokens(reqs, hashes) == 2 * BS


def test_request_waits_for_blocks_held_by_running_ones():
    # Both arrive together; the pool fits one, so the second runs after the first finishes.
    reqs = [TraceRequest(0, PROMPT, 100, (0, 1, 2, 3)), TraceRequest(0, PROMPT, 1, (0, 1, 2, 4))]
    result = replay(reqs, hashed(reqs), Capacity(4))
    assert result.max_running == 1
    assert result.gpu_hit_tokens == 3 * BS
    too_big = [TraceRequest(0, 9 * BS, 1, tuple(range(9)))]
    assert replay(too_big, hashed(too_big), Capacity(4)).skipped_requests == 1


@pytest.mark.parametrize("workload", ["chat", "agent"])
def test_oracle_bounds_tiered_bounds_gpu_only(workload: str):
    reqs = WORKLOADS[workload](3)[:400]
    hashes = hashed(reqs)
    distinct = len({h for hs in hashes for h in hs})
    gpu = max(distinct // 20, 40)
    tiered = replay(reqs, hashes, Capacity(gpu, 4 * gpu * BLOCK_BYTES, 8 * gpu * BLOCK_BYTES))
    gpu_only = replay(reqs, hashes, Capacity(gpu))
    oracle = oracle_saved_tokens(reqs, hashes)
    assert oracle >= tiered.saved_tokens >= gpu_only.saved_tokens
    assert tiered.saved_tokens > gpu_only.saved_tokens
    # The lower tiers only add hits: the GPU pool evolves the same with or without them.
    assert tiered.gpu_hit_tokens == gpu_only.saved_tokens
    assert tiered.corrupt_blocks == 0


def run_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    parser = argparse.ArgumentParser()
    replay_cmd.add_arguments(parser)
    assert replay_cmd.run(parser.parse_args([*argv, "--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_command_on_trace_file(tmp_path, capsys):
    reqs = [request(0, [0, 1, 2]), request(1, [5, 6, 7]), request(2, [0, 1, 2])]
    path = tmp_path / "trace.jsonl"
    write_trace(path, reqs)
    out = run_command(
        ["--trace", str(path), "--gpu-blocks", "4", "--host-bytes", "8K", "--disk-bytes", "0"],
        capsys,
    )
    for key in (
        "gpu_hit_tokens",
        "host_hit_tokens",
        "disk_hit_tokens",
        "saved_tokens",
        "gpu_only_saved_tokens",
        "oracle_saved_tokens",
        "saved_vs_oracle",
        "saved_vs_gpu_only",
    ):
        assert key in out
    assert out["host_hit_tokens"] == 3 * BS
    assert out["saved_vs_oracle"] == 1.0
    assert out["saved_vs_gpu_only"] is None  # GPU-only saved nothing: no finite ratio
    assert out["sized_from_trace"] is False


def test_command_sizes_tiers_from_trace_and_plots(tmp_path, capsys):
    png = tmp_path / "replay.png"
    out = run_command(["--workload", "chat", "--limit", "150", "--plot", str(png)], capsys)
    assert out["sized_from_trace"] is True
    assert out["gpu_blocks"] == -(-out["distinct_blocks"] // 10)
    assert out["disk_blocks"] == out["distinct_blocks"]
    assert out["saved_vs_oracle"] == pytest.approx(1.0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(out["sweep"]) >= 3


def test_unique_workload_saves_nothing(capsys):
    out = run_command(["--workload", "unique", "--limit", "300"], capsys)
    assert out["saved_tokens"] == out["oracle_saved_tokens"] == 0
    assert out["corrupt_blocks"] == 0


def test_malformed_trace_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
        '{"timestamp": 1, "input_length": 600}\n'
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_trace(path)


def test_parse_bytes():
    assert replay_cmd.parse_bytes("4096") == 4096
    assert replay_cmd.parse_bytes("64M") == 64 << 20
    assert replay_cmd.parse_bytes("2GiB") == 2 << 30
    with pytest.raises(argparse.ArgumentTypeError):
        replay_cmd.parse_bytes("lots")
