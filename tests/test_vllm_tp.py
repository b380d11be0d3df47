"""Tensor parallelism and load failures under vLLM's real Scheduler (``vllmharness``).

A second worker connector is built for rank 1 and the two ranks' outputs go through vLLM's own
``KVOutputAggregator``: a lookup takes only the hit every rank holds, and a load error on one
rank rewinds the stores computed over it. Without tensor parallelism, a failed load (a block the
daemon lost) stores no block computed over it, sync or async, after a preemption too.

Run in the vLLM venv: ``VLLM_TARGET_DEVICE=cpu pytest -m vllm tests/test_vllm_tp.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")

import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput

import kvtier.connector.vllm.connector as connector_module
from kvtier.connector.vllm.metadata import KVTierMetadata, pack, unpack

import vllmdaemon
import vllmharness as harness
from daemonutil import Daemon
from tinymodel import BLOCK, BLOCK_BYTES, check_then_write
from vllmdaemon import flood
from vllmharness import Engine, all_tokens, computed_tokens, prompt, runner_output, settle

pytestmark = pytest.mark.vllm

_none_hash = harness._none_hash
daemon = vllmdaemon.daemon
model_dir = harness.model_dir
make_engine = harness.make_engine

BOGUS = b"\xee" * 16


def spoil_hash(packed: bytes, index: int) -> bytes:
    """``packed`` with the hash of block ``index`` replaced by one nobody stores."""
    hashes = unpack(packed)
    hashes[index] = BOGUS
    return pack(hashes)


# ---------------------------------------------------------------- two tensor-parallel ranks


class TPEngine(Engine):
    """The harness's engine with ``tensor_parallel_size=2``: its worker is rank 0, and a
    second worker connector (rank 1, its own KV tensors) loads and stores beside it.

    The fake forward writes both ranks' tensors; before it does, every token a request reads
    must hold its values on rank 1 too. A load error on any rank spoils the forward on every
    rank (TP ranks exchange activations), as vLLM assumes.
    """

    def __init__(self, daemon: Daemon, model_dir: Path, monkeypatch, **extra):
        make_config = harness.make_vllm_config

        def tp_config(*args):
            config = make_config(*args)
            config.parallel_config.tensor_parallel_size = 2
            return config

        with monkeypatch.context() as patch:
            patch.setattr(harness, "make_vllm_config", tp_config)
            super().__init__(daemon, model_dir, **extra)
            patch.setattr(connector_module, "_tp_rank", lambda: 1)
            self.rank1 = KVConnectorFactory.create_connector(
                config=self.vllm_config,
                role=KVConnectorRole.WORKER,
                kv_cache_config=self.kv_cache_config,
            )
        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        self.rank1_caches = harness.allocate_kv_cache(
            self.kv_cache_config, torch.device("cpu"), layout
        )
        self.rank1.register_kv_caches(self.rank1_caches)
        self.workers = [self.worker, self.rank1]
        self.aggregator = KVOutputAggregator(expected_finished_count=2)

    def step(self, wait_for_lookups: bool = True) -> bool:
        if wait_for_lookups:
            self.connector.scheduler.hits.wait_for_lookups(timeout=60)
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        for worker in self.workers:
            worker.bind_connector_metadata(meta)
            worker.handle_preemptions(meta)
        self.preemptions += len(out.preempted_req_ids or ())
        if self.before_load is not None:
            self.before_load(meta)
        errors: list[set[int]] = [set(), set()]
        if out.has_sync_kv_loads:
            for rank, worker in enumerate(self.workers):
                worker.start_load_kv(None)
                errors[rank] = worker.get_block_ids_with_load_errors()
        spoiled = errors[0] | errors[1]
        sampled = self._forward(out, spoiled)
        self._forward_rank1(out, spoiled)
        outputs = []
        for rank, worker in enumerate(self.workers):
            if not out.has_sync_kv_loads:
                worker.start_load_kv(None)
            worker.wait_for_save()
            results = worker.get_transfer_results(out.finished_req_ids)
            kv_output = KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=errors[rank] | worker.get_block_ids_with_load_errors(),
                kv_connector_stats=self._take_stats() if rank == 1 else None,
            )
            worker.clear_connector_metadata()
            outputs.append(runner_output(sampled, kv_output))
        engine_outputs = self.scheduler.update_from_output(out, self.aggregator.aggregate(outputs))
        for sched_stats in (o.scheduler_stats for o in engine_outputs.values()):
            if sched_stats is not None and sched_stats.connector_prefix_cache_stats is not None:
                for source, n in sched_stats.connector_prefix_cache_stats.hits_by_source.items():
                    self.hit_sources[source] = self.hit_sources.get(source, 0) + n
        return out.total_num_scheduled_tokens > 0

    def _forward_rank1(self, out, spoiled: set[int]) -> None:
        computed = computed_tokens(out)
        for req_id, num in out.num_scheduled_tokens.items():
            if spoiled.intersection(self.block_tables[req_id]):
                continue
            start, end = computed[req_id], computed[req_id] + num
            tokens = list(self.scheduler.requests[req_id].all_token_ids)[:end]
            check_then_write(
                self.rank1_caches, self.block_tables[req_id], start, tokens, f"{req_id} (rank 1)"
            )

    def _take_stats(self):
        stats = None
        for worker in self.workers:
            mine = worker.get_kv_connector_stats()
            if mine is not None:
                stats = mine if stats is None else stats.aggregate(mine)
        if stats is not None:
            for key, value in stats.data.items():
                self.stats[key] = self.stats.get(key, 0) + value
        return stats

    def run(self) -> int:
        steps = 0
        while self.scheduler.has_requests():
            assert steps < harness.MAX_STEPS, "the scheduler never drained"
            if not self.step():
                for worker in self.workers:
                    worker.worker.wait_for_loads(timeout=60)
            steps += 1
        for worker in self.workers:
            worker.worker.drain()
        self._take_stats()
        return steps

    def close(self) -> None:
        self.rank1.shutdown()
        super().close()


@pytest.fixture
def make_tp_engine(daemon, model_dir: Path, monkeypatch):
    yield from harness.closing_each(
        lambda **kwargs: TPEngine(daemon, model_dir, monkeypatch, **kwargs)
    )


# ---------------------------------------------------------------- item 5: tensor parallelism


def test_tp_lookup_takes_the_hit_every_rank_holds(make_tp_engine) -> None:
    shared = prompt(30, 4 * BLOCK)
    first = make_tp_engine()

    def lose_rank1_block2(meta: KVTierMetadata) -> None:
        for store in meta.stores:
            if store.req_id == "a" and len(unpack(store.hashes[1])) > 2:
                # Rank 1's store of block 2 goes under a hash nobody asks for: it lacks it.
                store.hashes = (store.hashes[0], spoil_hash(store.hashes[1], 2))

    first.before_load = lose_rank1_block2
    first.add([*shared, 1], "a")
    first.run()
    assert first.stats["stored_blocks"] == 8

    second = make_tp_engine()
    second.add([*shared, 2], "b")
    second.run()
    assert second.stats["loaded_blocks"] == 2 * 2  # blocks 0-1, on both ranks
    assert "load_failed_blocks" not in second.stats
    # It computed blocks 2-3 and stored them where they were missing: block 2 on rank 1.
    assert second.stats["stored_blocks"] == 1
    assert second.stats["deduplicated_blocks"] == 3

    third = make_tp_engine()
    third.add([*shared, 3], "c")
    third.run()
    assert third.stats["loaded_blocks"] == 4 * 2
    assert "load_failed_blocks" not in third.stats
    assert third.hit_sources == {CacheHitSource.HOST: 4 * BLOCK}


def test_tp_load_error_on_one_rank_rewinds_stores(make_tp_engine) -> None:
    shared = prompt(31, 4 * BLOCK)
    first = make_tp_engine(load_async=False)
    first.add([*shared, 1], "a")
    first.run()

    # Rank 1 cannot get block 2 after the lookup said every rank holds it (evicted between
    # the lookup and the acquire): vLLM recomputes blocks 2-3 on every rank.
    second = make_tp_engine(load_async=False)

    def rank1_misses_block2(meta: KVTierMetadata) -> None:
        for load in meta.loads:
            load.hashes = (load.hashes[0], spoil_hash(load.hashes[1], 2))
        second.before_load = None

    second.before_load = rank1_misses_block2
    second.add([*shared, *prompt(32, 2 * BLOCK), 2], "b")
    second.run()
    assert second.stats["load_failed_blocks"] == 2
    # The recomputed blocks 2-3 are offered to the daemon again (each rank keeps what it
    # holds), and the blocks computed on top of the failed load were stored only after it.
    assert second.stats["deduplicated_blocks"] == 2 * 2

    third = make_tp_engine(load_async=False)
    third.add([*shared, *prompt(32, 2 * BLOCK), 3], "c")
    third.run()
    assert third.stats["loaded_blocks"] == 6 * 2
    assert "load_failed_blocks" not in third.stats


@pytest.fixture
def small_daemon():
    """A daemon whose host tier holds 16 blocks and has no disk tier, so a flood evicts; its
    lookups hold nothing for the acquire (they would keep the flood from evicting)."""
    d = Daemon(host_bytes=16 * BLOCK_BYTES, disk_bytes=0, extra=["--lookup-hold-s", "0"])
    d.start()
    yield d
    d.cleanup()


def test_sync_load_failure_stores_no_block_computed_over_it(make_engine, small_daemon) -> None:
    shared = prompt(33, 4 * BLOCK)
    tail = prompt(34, 2 * BLOCK)
    first = make_engine(daemon=small_daemon)
    first.add([*shared, 1], "a")
    first.run()

    second = make_engine(daemon=small_daemon, load_async=False)

    def evict(meta: KVTierMetadata) -> None:
        if meta.loads:
            flood(second, small_daemon, 32)
            second.before_load = None

    second.before_load = evict
    second.add([*shared, *tail, 2], "b")
    second.run()
    assert second.stats["load_failed_blocks"] == 4
    assert second.stats["stored_blocks"] == 6  # all of it, once recomputed

    third = make_engine(daemon=small_daemon)
    third.add([*shared, *tail, 3], "c")
    third.run()
    assert third.stats["loaded_blocks"] == 6  # and every one of them exact
    assert "load_failed_blocks" not in third.stats


def test_async_load_failure_after_preemption_rewinds_stores(make_engine, small_daemon) -> None:
    engine = make_engine(daemon=small_daemon)
    request = engine.add([*prompt(35, 4 * BLOCK), 1], "a", max_tokens=2 * BLOCK)
    for _ in range(3):
        engine.step()
    settle(engine)
    assert engine.stats["stored_blocks"] == 4
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)

    def evict(meta: KVTierMetadata) -> None:
        if meta.loads:
            flood(engine, small_daemon, 32)
            engine.before_load = None

    engine.before_load = evict
    engine.run()
    assert engine.stats["load_failed_blocks"] >= 4  # (a load that got no slot counts twice)
    tokens = all_tokens(request)

    second = make_engine(daemon=small_daemon)
    second.add([*tokens, 2], "b")
    second.run()
    assert second.stats["loaded_blocks"] == (len(tokens) - 1) // BLOCK
    assert "load_failed_blocks" not in second.stats
