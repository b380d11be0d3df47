"""Trace replay over several nodes sharing a remote tier (a real redis-server): hand-computed
remote hits, the same nodes without the remote tier, the routers, the command's JSON."""

from __future__ import annotations

import argparse
import json

import pytest

from kvtier.bench.redis_server import RedisProcess
from kvtier.bench.replay import command as replay_cmd
from kvtier.bench.replay.fleet import route, run_fleet
from kvtier.bench.replay.sim import REPLAY_LAYOUT, Capacity, Workload, oracle_saved_tokens
from kvtier.bench.replay.trace import TraceHasher, TraceRequest, write_trace
from kvtier.bench.replay.workloads import WORKLOADS
from kvtier.tiers.hashing import Namespace

BS = 512
BLOCK_BYTES = REPLAY_LAYOUT.block_bytes
PROMPT = 3 * BS + 10  # three full blocks and a partial one
NODE = Capacity(8, host_bytes=16 * BLOCK_BYTES, disk_bytes=64 * BLOCK_BYTES)


def request(t_s: float, ids: list[int]) -> TraceRequest:
    return TraceRequest(t_s * 1000, PROMPT, 1, (*ids, 1000 + int(t_s)))


def workload(requests: list[TraceRequest]) -> Workload:
    hasher = TraceHasher(Namespace("test", REPLAY_LAYOUT.signature))
    hashes = [hasher.hashes(r) for r in requests]
    return Workload("test", requests, hashes, hasher.distinct_blocks, 0.0)


def run_two_nodes(work: Workload, routes: list[int], store_url: str | None):
    return run_fleet(
        work, NODE, 2, routes, store_url=store_url, ms_per_output_token=20.0, label="test"
    )


@pytest.fixture
def store():
    with RedisProcess(maxmemory=64 << 20) as server:
        yield server


def test_prefix_computed_on_one_node_is_a_remote_hit_on_another(store):
    # Node 0 computes the prefix; node 1 has never seen it; then node 0 again.
    work = workload([request(0, [0, 1, 2]), request(1, [0, 1, 2]), request(2, [0, 1, 2])])
    shared, per_node, remote = run_two_nodes(work, [0, 1, 0], store.url)
    assert per_node[1].remote_hit_tokens == 3 * BS
    assert (per_node[1].gpu_hit_tokens, per_node[1].host_hit_tokens) == (0, 0)
    assert per_node[1].disk_hit_tokens == 0
    # Node 0 still holds its own copy: the third request never asks the remote tier.
    assert per_node[0].remote_hit_tokens == 0
    assert per_node[0].saved_tokens == 3 * BS
    assert shared.corrupt_blocks == 0  # node 1's blocks came back byte for byte
    assert remote.blocks_stored == 3  # the three full blocks, written once, by node 0
    assert remote.blocks_loaded == 3

    alone, per_node, _ = run_two_nodes(work, [0, 1, 0], None)
    assert per_node[1].saved_tokens == 0  # without the remote tier node 1 recomputes
    assert alone.remote_hit_tokens == 0
    assert shared.saved_tokens - alone.saved_tokens == 3 * BS


def test_a_remote_hit_lands_in_the_nodes_own_tiers(store):
    # Node 1 fetches the prefix once; its later requests find it in its own tiers.
    work = workload([request(0, [0, 1, 2]), request(1, [0, 1, 2]), request(2, [0, 1, 2])])
    _, per_node, remote = run_two_nodes(work, [0, 1, 1], store.url)
    assert per_node[1].remote_hit_tokens == 3 * BS
    assert per_node[1].saved_tokens == 6 * BS
    assert remote.blocks_loaded == 3


def test_routers():
    assert route(5, 2, "round-robin") == [0, 1, 0, 1, 0]
    picks = route(200, 3, "random", seed=7)
    assert picks == route(200, 3, "random", seed=7)
    assert picks != route(200, 3, "random", seed=8)
    assert set(picks) == {0, 1, 2}
    with pytest.raises(ValueError):
        route(3, 2, "least-loaded")
    with pytest.raises(ValueError):
        route(3, 0, "round-robin")


def run_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    parser = argparse.ArgumentParser()
    replay_cmd.add_arguments(parser)
    assert replay_cmd.run(parser.parse_args([*argv, "--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_command_reports_remote_hits_against_the_same_nodes_without(tmp_path, capsys):
    reqs = [request(0, [0, 1, 2]), request(1, [0, 1, 2]), request(2, [5, 6, 7])]
    path = tmp_path / "trace.jsonl"
    write_trace(path, reqs)
    sizes = ["--gpu-blocks", "8", "--host-bytes", "16K", "--disk-bytes", "64K"]
    out = run_command(["--trace", str(path), *sizes, "--nodes", "2"], capsys)
    assert (out["nodes"], out["router"], out["node_requests"]) == (2, "round-robin", [2, 1])
    assert out["remote_hit_tokens"] == 3 * BS
    assert out["saved_tokens"] == 3 * BS
    assert out["no_remote_saved_tokens"] == 0
    assert out["gpu_only_saved_tokens"] == 0
    assert out["saved_vs_oracle"] == 1.0
    assert out["corrupt_blocks"] == out["remote_fault_misses"] == 0


def test_command_random_router_on_a_workload(capsys):
    out = run_command(
        ["--workload", "chat", "--limit", "200", "--nodes", "3", "--router", "random"], capsys
    )
    assert out["router"] == "random" and sum(out["node_requests"]) == 200
    assert out["remote_hit_tokens"] > 0
    assert out["oracle_saved_tokens"] >= out["saved_tokens"] > out["no_remote_saved_tokens"]
    assert out["no_remote_saved_tokens"] >= out["gpu_only_saved_tokens"]
    assert out["corrupt_blocks"] == out["remote_checksum_failures"] == 0
    reqs = WORKLOADS["chat"](0)[:200]
    assert out["oracle_saved_tokens"] == oracle_saved_tokens(reqs, workload(reqs).hashes)


def test_command_refuses_plot_with_nodes(tmp_path):
    parser = argparse.ArgumentParser()
    replay_cmd.add_arguments(parser)
    args = parser.parse_args(
        ["--workload", "chat", "--nodes", "2", "--plot", str(tmp_path / "p.png")]
    )
    with pytest.raises(SystemExit, match="--plot"):
        replay_cmd.run(args)
    with pytest.raises(SystemExit):
        parser.parse_args(["--workload", "chat", "--nodes", "0"])
