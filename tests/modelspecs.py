"""The models of the connector's model tests (``test_vllm_models``, ``test_vllm_pipeline``):
vLLM KV cache specs of their layers, and the fixtures that run them under vLLM's Scheduler
(``modelutil``'s engines) against a daemon of their own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

import vllmharness as harness
from daemonutil import Daemon
from modelutil import Model, ModelEngine

B = 16
WINDOW = 128
PREFIX_BLOCKS = 18  # ends inside a local-attention chunk of 64 tokens
BF16 = torch.bfloat16

model_dir = harness.model_dir


def full(heads: int = 2, head: int = 64, dtype=BF16, **kw) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=B, num_kv_heads=heads, head_size=head, dtype=dtype, **kw)


def sliding(heads: int = 2, head: int = 64) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=B, num_kv_heads=heads, head_size=head, dtype=BF16, sliding_window=WINDOW
    )


def mla(block: int = B) -> MLAAttentionSpec:
    # DeepSeek's latent: kv_lora_rank 512 + rope 64, one "head", identical on every TP rank.
    return MLAAttentionSpec(
        block_size=block,
        num_kv_heads=1,
        head_size=576,
        dtype=BF16,
        max_tp_shards=1,
        cache_dtype_str="auto",
    )


def layers(*specs) -> dict[str, object]:
    return {f"model.layers.{i}.self_attn.attn": spec for i, spec in enumerate(specs)}


def prompt(seed: int, n: int) -> list[int]:
    return harness.prompt(seed, n)


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=8 << 20, disk_bytes=64 << 20)
    d.start()
    yield d
    d.cleanup()


@pytest.fixture
def make_engine(daemon: Daemon, model_dir: Path, monkeypatch):
    def build(model: Model, **kwargs) -> ModelEngine:
        engine_daemon = kwargs.pop("daemon", daemon)
        engine_dir = kwargs.pop("model_dir", model_dir)
        return ModelEngine(engine_daemon, engine_dir, model, monkeypatch, **kwargs)

    yield from harness.closing_each(build)


def window_blocks(group, hit_tokens: int) -> int:
    """Blocks a hit of ``hit_tokens`` loads in ``group``: from its window start on."""
    return hit_tokens // group.block_size - group.first_needed_block(hit_tokens)


def stored_per_prefix(engine: ModelEngine, blocks: int) -> int:
    """Blocks one engine stores for a prompt of ``blocks`` full blocks: each group's blocks,
    once per distinct shard (ranks holding one shard store it once) of every stage."""
    model = engine.model
    return sum(blocks * (model.tp // group.tp_replicas) * model.pp for group in engine.groups)
