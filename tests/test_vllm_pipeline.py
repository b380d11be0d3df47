"""Pipeline parallelism under vLLM's real Scheduler: each stage stores and loads its own
layers (``modelutil``'s fake forward checks every layer's bytes on every stage), a hit needs
every stage's blocks, and stages that kvtier could not tell apart are refused.

Run in the vLLM venv: ``VLLM_TARGET_DEVICE=cpu pytest -m vllm tests/test_vllm_pipeline.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import xxhash

pytest.importorskip("vllm")

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connector.vllm.groups import Pipeline, groups_from_kv_cache_config
from kvtier.connector.vllm.metadata import KVTierMetadata, pack, unpack

import modelspecs
import vllmharness as harness
from modelspecs import PREFIX_BLOCKS, B, full, layers, prompt, sliding, stored_per_prefix
from modelutil import Model
from vllmdaemon import daemon_stats

pytestmark = pytest.mark.vllm

_none_hash = harness._none_hash
daemon = modelspecs.daemon
make_engine = modelspecs.make_engine
model_dir = modelspecs.model_dir


PIPELINES = {
    # An even split: both stages' blocks have one layout, so only the stage's layer range
    # in their namespace tells them apart.
    "pp2": Model("pp", layers(*[full()] * 4), pp=2),
    # vLLM splits 3 layers 2 + 1: the stages' layouts differ too.
    "pp2-uneven-tp2": Model("pp", layers(*[full()] * 3), tp=2, pp=2),
}


def pipeline_model_dir(root: Path, model: Model) -> Path:
    """A model directory whose config has ``model``'s layers (vLLM splits those over stages)."""
    path = root / f"{len(model.layers)}-layers"
    path.mkdir(exist_ok=True)
    config = {**harness.TINY_LLAMA, "num_hidden_layers": len(model.layers)}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_each_pipeline_stage_stores_and_loads_its_own_layers(make_engine, daemon, tmp_path, name):
    """The fake forward checks every layer's bytes: a stage that loaded another stage's
    layers fails it."""
    model = PIPELINES[name]
    model_dir = pipeline_model_dir(tmp_path, model)
    shared = prompt(12, PREFIX_BLOCKS * B)
    first = make_engine(model, model_dir=model_dir)
    (group,) = first.groups
    seeds = {ns.seed for ns in group.namespaces("m")}
    assert len(seeds) == model.pp * model.tp  # one namespace per stage and shard
    first.add([*shared, 1], "a")
    first.run()
    assert first.stats["stored_blocks"] == stored_per_prefix(first, PREFIX_BLOCKS)
    # Nothing was "already stored" under another stage's name (one host tier per layout).
    hosts = [t for t in daemon_stats(daemon)["tiers"] if t["tier"] == "host"]
    assert sum(t["used_blocks"] for t in hosts) == stored_per_prefix(first, PREFIX_BLOCKS)

    second = make_engine(model, model_dir=model_dir)
    second.add([*shared, 2], "b")
    second.run()
    assert second.hit_sources == {CacheHitSource.HOST: PREFIX_BLOCKS * B}
    assert "load_failed_blocks" not in second.stats
    assert second.checked_tokens >= PREFIX_BLOCKS * B
    assert second.stats["loaded_blocks"] == PREFIX_BLOCKS * model.tp * model.pp


def test_a_hit_needs_every_pipeline_stage(make_engine, tmp_path):
    """The scheduler asks for every stage's shard: blocks the second stage lacks are no hit,
    though the first stage holds them."""
    model = PIPELINES["pp2"]
    model_dir = pipeline_model_dir(tmp_path, model)
    shared = prompt(13, PREFIX_BLOCKS * B)
    first = make_engine(model, model_dir=model_dir)
    kept = 5

    def lose_second_stage_blocks(meta: KVTierMetadata) -> None:
        for store in meta.stores:
            hashes = unpack(store.hashes[1])  # stage 1's shard
            lost = [xxhash.xxh3_128_digest(h) if i >= kept else h for i, h in enumerate(hashes)]
            store.hashes = (store.hashes[0], pack(lost))

    first.before_load = lose_second_stage_blocks
    first.add([*shared, 1], "a")  # computed in one step: its stores start at block 0
    first.run()

    second = make_engine(model, model_dir=model_dir)
    second.add([*shared, 2], "b")
    second.run()
    assert second.hit_sources == {CacheHitSource.HOST: kept * B}
    assert "load_failed_blocks" not in second.stats


def stage_config(names: list[str], *specs) -> SimpleNamespace:
    """A stage's KV cache config: one group per spec, of the layers ``names``."""
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=s) for s in specs]
    )


def test_pipeline_parallelism_is_refused_where_stages_cannot_be_told_apart():
    stages = Pipeline(((0, 2), (2, 2)), stage=1)
    later = ["model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"]
    (group,) = groups_from_kv_cache_config(stage_config(later, full()), pipeline=stages)
    assert group.shard(0) == 1
    # A hybrid model: vLLM shows the scheduler the first stage's layers of each group only.
    with pytest.raises(ValueError, match="one KV cache group"):
        groups_from_kv_cache_config(stage_config(later, full(), sliding()), pipeline=stages)
    # Layers that are not the stage's decoder layers, one each (a draft model's, say).
    for names in (later[:1], [*later, "mtp.layers.4.attn"], ["model.layers.1.self_attn.attn"]):
        with pytest.raises(ValueError, match=r"pipeline stage 1 holds decoder layers 2\.\.3"):
            groups_from_kv_cache_config(stage_config(names, full()), pipeline=stages)
