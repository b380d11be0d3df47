"""``kvtier bench serve`` end to end on a tiny model, its conversation sampling and its loop."""

from __future__ import annotations

import argparse
import json
import sys

import pytest
import torch

from kvtier.bench.replay.trace import TRACE_BLOCK_TOKENS, TraceRequest, write_trace
from kvtier.bench.serve import command as serve_cmd
from kvtier.bench.serve.clock import EngineClock
from kvtier.bench.serve.loop import ServingLoop
from kvtier.bench.serve.sample import (
    ServeRequest,
    common_prefix,
    conversations,
    sample_conversations,
    to_serve_requests,
)
from kvtier.bench.serve.vllm_command import NOT_AVAILABLE_EXIT, fit
from kvtier.engine.config import ModelConfig
from kvtier.engine.engine import Engine
from kvtier.engine.model import Decoder
from kvtier.tiers.stack import build_stack

BS = TRACE_BLOCK_TOKENS
ARM_KEYS = (
    "name",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "prompt_tokens_per_s",
    "output_tokens_per_s",
    "prefill_tokens_computed",
    "hit_tokens",
)


def turns(
    conversation: int, count: int, start_s: float, gap_s: float, system: tuple[int, ...] = (0,)
) -> list[TraceRequest]:
    """A conversation behind the shared ``system`` blocks: each turn keeps the previous turn's
    full blocks and adds two fresh ones and a partial block."""
    out: list[TraceRequest] = []
    ids = list(system)
    for turn in range(count):
        ids = [*ids, conversation * 100 + 2 * turn + 1, conversation * 100 + 2 * turn + 2]
        partial = 1000 * conversation + turn
        out.append(
            TraceRequest(
                (start_s + turn * gap_s) * 1000,
                len(ids) * BS + 100,
                3 * BS // 16,
                (*ids, partial),
            )
        )
    return out


def interleaved(
    conversations_: int = 3, count: int = 3, system: tuple[int, ...] = (0,)
) -> list[TraceRequest]:
    """Conversations whose turns alternate, so each turn's predecessor is several requests back."""
    reqs = [
        r for c in range(conversations_) for r in turns(c + 1, count, c, conversations_, system)
    ]
    return sorted(reqs, key=lambda r: r.timestamp_ms)


def run_serve(argv: list[str], capsys) -> dict:
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    assert serve_cmd.run(parser.parse_args([*argv, "--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_conversations_group_turns_not_the_shared_system_block():
    reqs = interleaved()
    groups = conversations(reqs)
    assert len(groups) == 3
    for group in groups:
        firsts = {reqs[i].hash_ids[1] // 100 for i in group}
        assert len(firsts) == 1, "a conversation's turns share their first own block"


def test_a_prompt_of_only_the_shared_prefix_starts_no_conversation_of_others():
    system = (0, 1)
    system_only = TraceRequest(0.0, len(system) * BS + 100, 1, (*system, 999))
    reqs = [system_only, *interleaved(system=system)]
    assert common_prefix(reqs) == system
    assert sorted(len(g) for g in conversations(reqs)) == [1, 3, 3, 3]


def test_sample_takes_whole_conversations():
    reqs = interleaved()
    sample = sample_conversations(reqs, 7, seed=0)
    assert len(sample) == 6  # two whole conversations of three; a third would not fit
    assert [r.timestamp_ms for r in sample] == sorted(r.timestamp_ms for r in sample)
    assert len(conversations(sample)) == 2


def test_shrunk_prompts_share_exactly_the_trace_blocks():
    a, b = turns(1, 2, 0, 1)
    first, second = to_serve_requests([a, b], 16, vocab_size=256)
    assert len(first.prompt) == 3 * 16 + -(-100 * 16 // BS)
    assert second.prompt[: 3 * 16] == first.prompt[: 3 * 16]
    assert second.prompt[3 * 16 : 4 * 16] != first.prompt[3 * 16 : 4 * 16]
    assert first.output_tokens == 3
    assert (first.arrival_s, second.arrival_s) == (0.0, 1.0)


def test_loop_interleaves_requests_and_matches_one_at_a_time():
    config = ModelConfig.tiny()
    model = Decoder(config)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        tuple(torch.randint(0, config.vocab_size, (40 + 9 * i,), generator=gen).tolist())
        for i in range(4)
    ]
    reqs = [ServeRequest(0.0, p, 5) for p in prompts]
    alone = []
    for p in prompts:
        engine = Engine(model, build_stack(config.kv_layout(16), 64))
        result = ServingLoop(engine, max_running=4, step_tokens=64, clock=EngineClock).run(
            [ServeRequest(0.0, p, 5)], [0.0]
        )
        alone.append(result.outcomes[0].tokens)
    engine = Engine(model, build_stack(config.kv_layout(16), 64))
    together = ServingLoop(engine, max_running=4, step_tokens=64, clock=EngineClock).run(
        reqs, [0.0] * 4
    )
    assert together.max_running == 4, "every request was in flight at once"
    assert [o.tokens for o in together.outcomes] == alone
    assert all(len(o.tokens) == 5 for o in together.outcomes)
    assert engine.stack.pool.num_free == 64, "every block was given back"


def test_loop_refuses_a_request_larger_than_the_pool():
    config = ModelConfig.tiny()
    engine = Engine(Decoder(config), build_stack(config.kv_layout(16), 2))
    loop = ServingLoop(engine, max_running=2, step_tokens=32, clock=EngineClock)
    with pytest.raises(ValueError, match="the pool has 2"):
        loop.run([ServeRequest(0.0, tuple(range(40)), 1)], [0.0])


def test_command_serves_three_arms_with_the_same_tokens(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    write_trace(path, interleaved())
    png = tmp_path / "ttft.png"
    out = run_serve(
        [
            "--trace",
            str(path),
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--chunk-blocks",
            "1",
            "--time-scale",
            "1",
            "--disk-dir",
            str(tmp_path),
            "--plot",
            str(png),
        ],
        capsys,
    )
    arms = {a["name"]: a for a in out["arms"]}
    assert list(arms) == ["engine-only", "kvtier-host", "kvtier-host-disk"]
    for arm in arms.values():
        assert all(key in arm for key in ARM_KEYS)
        assert set(arm["hit_tokens"]) == {"gpu", "host", "disk"}
        assert arm["requests"] == 9
    assert out["outputs_identical"] is True
    base = arms["engine-only"]["prefill_tokens_computed"]
    for name in ("kvtier-host", "kvtier-host-disk"):
        assert arms[name]["prefill_tokens_computed"] < base
    assert arms["engine-only"]["hit_tokens"]["host"] == 0
    # The disk tier holds every block, and the requests come one after another: that arm
    # takes all an unbounded cache could, and no arm takes more.
    hits = {name: sum(arm["hit_tokens"].values()) for name, arm in arms.items()}
    assert hits["kvtier-host-disk"] == out["reusable_prompt_tokens"] > 0
    assert max(hits.values()) == out["reusable_prompt_tokens"]
    assert {"ttft_p50_ratio", "throughput_ratio", "best_arm"} <= set(out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([png.name, path.name]), "the disk tiers' directories are gone"


def test_command_on_the_wall_clock_runs_the_arms_in_turn(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    write_trace(path, interleaved())
    argv = ["--trace", str(path), "--model", "tiny", "--device", "cpu", "--clock", "wall"]
    argv += ["--chunk-blocks", "1", "--time-scale", "0.001", "--disk-dir", str(tmp_path)]
    out = run_serve(argv, capsys)
    assert out["clock"] == "wall"
    assert out["outputs_identical"] is True
    computed = [a["prefill_tokens_computed"] for a in out["arms"]]
    assert computed[1] < computed[0] and computed[2] < computed[0]


def test_vllm_engine_without_vllm_says_so_and_measures_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # vLLM not importable, wherever this runs
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    argv = ["--workload", "chat", "--engine", "vllm", "--disk-dir", str(tmp_path), "--json"]
    assert serve_cmd.run(parser.parse_args(argv)) == NOT_AVAILABLE_EXIT
    captured = capsys.readouterr()
    assert "--engine vllm needs vLLM importable" in captured.err
    assert "nothing was measured" in captured.err
    assert captured.out == ""
    assert list(tmp_path.iterdir()) == []


def test_reference_engine_refuses_a_model_it_does_not_have(capsys):
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    args = parser.parse_args(["--workload", "chat", "--model", "meta-llama/Llama-3.2-1B"])
    with pytest.raises(SystemExit, match="reference engine's --model is one of"):
        serve_cmd.run(args)


def test_vllm_requests_are_cut_to_the_model_length_outputs_first():
    requests = [ServeRequest(0.0, tuple(range(900)), 600), ServeRequest(1.0, tuple(range(40)), 3)]
    cut = fit(requests, 512)
    assert [(len(r.prompt), r.output_tokens) for r in cut] == [(256, 256), (40, 3)]
    assert cut[0].prompt == requests[0].prompt[:256], "a cut prompt keeps its prefix"


def test_calibration_offers_enough_requests_to_fill_the_batch():
    """A step costs about the same for one decoding request as for a full batch: the
    calibration keeps the batch full where the sample can (a sixth of 16 requests, 3 of them,
    measured a GPU engine of 32 rows at a tenth of its rate)."""
    requests = [f"r{i}" for i in range(320)]
    assert serve_cmd.calibration_sample(requests, 8) == requests[::6]
    assert serve_cmd.calibration_sample(requests[:60], 8) == requests[:60:3]
    assert serve_cmd.calibration_sample(requests[:16], 32) == requests[:16]
    for count, rows in ((320, 32), (100, 8), (40, 4)):
        assert len(serve_cmd.calibration_sample(requests[:count], rows)) >= 2 * rows
