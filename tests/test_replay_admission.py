"""``kvtier bench replay --admission``: the policy reaches the replay's host tier, and the
replay reports what the disk wrote for the tokens it saved."""

from __future__ import annotations

import argparse
import json

import pytest

from kvtier.bench.replay import command as replay_cmd
from kvtier.bench.replay.sim import REPLAY_LAYOUT, Capacity, replay
from kvtier.bench.replay.trace import TraceHasher, TraceRequest
from kvtier.tiers.hashing import Namespace
from kvtier.tiers.host.admission import DEFAULT_POLICY, POLICIES

BS = 512
BLOCK_BYTES = REPLAY_LAYOUT.block_bytes
PROMPT = 3 * BS + 10


def request(t_s: float, ids: list[int]) -> TraceRequest:
    return TraceRequest(t_s * 1000, PROMPT, 1, (*ids, 1000 + len(ids) + int(t_s)))


def hashed(requests: list[TraceRequest]) -> list[list[bytes]]:
    hasher = TraceHasher(Namespace("test", REPLAY_LAYOUT.signature))
    return [hasher.hashes(r) for r in requests]


def test_hit_to_disk_keeps_blocks_never_read_back_off_the_disk():
    # The host holds three blocks: the third request pushes the first's blocks out of it.
    reqs = [request(0, [0, 1, 2]), request(1, [5, 6, 7]), request(2, [8, 9, 10])]
    reqs.append(request(3, [0, 1, 2]))
    cap = Capacity(4, host_bytes=3 * BLOCK_BYTES, disk_bytes=100 * BLOCK_BYTES)
    every = replay(reqs, hashed(reqs), cap, admission="all")
    assert every.disk_hit_tokens == 3 * BS
    assert every.disk_bytes_written == every.blocks_spilled_to_disk * BLOCK_BYTES > 0
    assert every.bytes_written_per_saved_token == every.disk_bytes_written / (3 * BS)
    hit = replay(reqs, hashed(reqs), cap, admission="hit-to-disk")
    assert (hit.disk_hit_tokens, hit.disk_bytes_written, hit.blocks_spilled_to_disk) == (0, 0, 0)
    assert hit.blocks_kept_off_disk == every.blocks_spilled_to_disk
    assert hit.bytes_written_per_saved_token is None  # nothing saved: no finite ratio
    assert hit.corrupt_blocks == every.corrupt_blocks == 0


def test_second_hit_turns_the_first_sighting_away():
    # GPU holds one request: the second recycles the first's blocks into the host tier.
    reqs = [request(0, [0, 1, 2]), request(1, [5, 6, 7]), request(2, [0, 1, 2])]
    cap = Capacity(4, host_bytes=8 * BLOCK_BYTES)
    assert replay(reqs, hashed(reqs), cap, admission="all").host_hit_tokens == 3 * BS
    second = replay(reqs, hashed(reqs), cap, admission="second-hit")
    assert second.host_hit_tokens == 0
    assert second.blocks_not_admitted >= 3


def run_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    parser = argparse.ArgumentParser()
    replay_cmd.add_arguments(parser)
    assert replay_cmd.run(parser.parse_args([*argv, "--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_command_reports_disk_bytes_per_saved_token_for_each_policy(capsys):
    out = {
        policy: run_command(["--workload", "chat", "--limit", "200", "--admission", policy], capsys)
        for policy in ("all", "hit-to-disk")
    }
    for policy, summary in out.items():
        assert summary["admission"] == policy
        assert summary["bytes_written_per_saved_token"] == pytest.approx(
            summary["disk_bytes_written"] / summary["saved_tokens"]
        )
        assert summary["corrupt_blocks"] == 0
    assert out["hit-to-disk"]["disk_bytes_written"] < out["all"]["disk_bytes_written"]
    assert out["hit-to-disk"]["blocks_kept_off_disk"] > 0


def test_command_help_lists_the_policies_and_the_default(capsys):
    parser = argparse.ArgumentParser()
    replay_cmd.add_arguments(parser)
    assert parser.parse_args(["--workload", "chat"]).admission == DEFAULT_POLICY
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    assert "{" + ",".join(POLICIES) + "}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["--workload", "chat", "--admission", "lru"])


def test_fed_as_the_daemon_all_writes_every_block_and_hit_to_disk_only_those_hit():
    # GPU holds one request: the third finds the first's blocks in the host tier.
    reqs = [request(0, [0, 1, 2]), request(1, [5, 6, 7]), request(2, [0, 1, 2])]
    cap = Capacity(4, host_bytes=8 * BLOCK_BYTES, disk_bytes=100 * BLOCK_BYTES)
    every = replay(reqs, hashed(reqs), cap, admission="all", as_daemon=True)
    hit = replay(reqs, hashed(reqs), cap, admission="hit-to-disk", as_daemon=True)
    assert every.host_hit_tokens == hit.host_hit_tokens == 3 * BS
    assert every.disk_bytes_written == 6 * BLOCK_BYTES  # every computed block, at once
    assert hit.disk_bytes_written == 3 * BLOCK_BYTES  # the first request's, once hit
