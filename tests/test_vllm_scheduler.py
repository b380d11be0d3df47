"""The scheduler side of KVTierConnector under vLLM's real Scheduler.

Each test drives vLLM's own ``Scheduler`` with the fake model runner of
``vllmharness`` (which checks, token by token, that every block a request reads holds
exactly its values) against a real daemon: aborts during a load, preemption, ``reset_cache``,
streaming input, the load failure policy, lookups and a frozen daemon. Tensor parallelism and
load failures are in ``test_vllm_tp.py``.

Run in the vLLM venv: ``VLLM_TARGET_DEVICE=cpu pytest -m vllm tests/test_vllm_scheduler.py``.
"""

from __future__ import annotations

import os
import signal

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from kvtier.connector.vllm.metadata import KVTierMetadata
from kvtier.connector.vllm.request import RequestHashes
from kvtier.connector.vllm.stats import KVTierStats
from kvtier.tiers.hashing import Namespace

import vllmdaemon
import vllmharness as harness
from daemonutil import Daemon, wait_until
from tinymodel import BLOCK
from vllmdaemon import assert_daemon_holds_nothing
from vllmharness import Engine, all_tokens, assert_scheduler_empty, kv_cache_config, prompt, settle

pytestmark = pytest.mark.vllm

# The harness's fixtures, used here as they are there.
_none_hash = harness._none_hash
daemon = vllmdaemon.daemon
model_dir = harness.model_dir
make_engine = harness.make_engine


# ---------------------------------------------------------------- helpers


# ---------------------------------------------------------------- item 1: abort during a load


def stop_daemon_at_load(engine: Engine, daemon: Daemon, req_id: str) -> None:
    """Freezes the daemon just before the step's loads start, so ``req_id``'s load stays in
    flight (its Acquire waits) until the test lets the daemon go."""

    def stop(meta: KVTierMetadata) -> None:
        if any(load.req_id == req_id for load in meta.loads):
            daemon.proc.send_signal(signal.SIGSTOP)
            engine.before_load = None

    engine.before_load = stop


def land_loads(engine: Engine) -> None:
    """Steps once more after the worker's loads landed, as a live engine would, so that vLLM
    hears of every load in finished_recving (after ``run`` saw no request left)."""
    engine.worker.worker.wait_for_loads(timeout=60)
    engine.step()


def test_abort_during_async_load_with_on_finish_stores_nothing(make_engine, daemon) -> None:
    first = make_engine(store_policy="on_finish")
    shared = prompt(20, 4 * BLOCK)
    first.add([*shared, 1], "a")
    first.run()
    second = make_engine(store_policy="on_finish", timeout_s=60)
    request = second.add([*shared, 2, 3], "b")
    stop_daemon_at_load(second, daemon, "b")
    second.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    second.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    daemon.proc.send_signal(signal.SIGCONT)
    # vLLM must see "b" in finished_recving only: a store over the blocks being loaded would
    # also report it in finished_sending, and vLLM's `assert req_id in self.requests` fires.
    second.run()
    land_loads(second)
    assert second.stats["loaded_blocks"] == 4
    assert "stored_blocks" not in second.stats
    assert "deduplicated_blocks" not in second.stats
    assert_scheduler_empty(second.scheduler)
    assert_daemon_holds_nothing(second, daemon)


def test_abort_during_async_load_after_preemption_is_not_held(make_engine, daemon) -> None:
    engine = make_engine(timeout_s=60)
    engine.add([*prompt(21, 4 * BLOCK), 1], "a", max_tokens=2 * BLOCK)
    for _ in range(3):
        engine.step()  # "a" ran and stored its prompt blocks
    settle(engine)
    assert engine.stats["stored_blocks"] == 4
    # Preempted with vLLM's prefix cache emptied: it comes back through kvtier.
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    stop_daemon_at_load(engine, daemon, "a")
    while engine.scheduler.requests["a"].status != RequestStatus.WAITING_FOR_REMOTE_KVS:
        engine.step()
    engine.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    daemon.proc.send_signal(signal.SIGCONT)
    engine.run()
    land_loads(engine)
    assert engine.stats["loaded_blocks"] == 4
    assert_scheduler_empty(engine.scheduler)
    assert_daemon_holds_nothing(engine, daemon)


# ---------------------------------------------------------------- item 2: preempted and resumed


@pytest.mark.parametrize("v2_runner", [False, True], ids=["runner-v1", "runner-v2"])
def test_preempted_and_resumed_in_one_step_keeps_its_blocks(make_engine, v2_runner) -> None:
    # min_hit_blocks=99: the connector answers at once, so vLLM resumes the request in the
    # very step that reports its preemption by reset_prefix_cache. vLLM reports a resumed
    # request among the cached requests, or for model runner V2 among the new ones.
    engine = make_engine(min_hit_blocks=99)
    engine.scheduler.use_v2_model_runner = v2_runner
    request = engine.add([*prompt(22, 3 * BLOCK), 1], "a", max_tokens=6 * BLOCK)
    for _ in range(4):
        engine.step()
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    preempted: list[set[str]] = []
    engine.before_load = lambda meta: preempted.append(set(meta.preempted))
    engine.step()
    engine.before_load = None
    assert preempted == [{"a"}]
    assert request.status == RequestStatus.RUNNING  # resumed in the same step
    engine.run()
    tokens = all_tokens(request)
    stored = (len(tokens) - 1) // BLOCK

    # Every block it stored holds what its hash names.
    second = make_engine()
    second.add([*tokens, 5], "b")
    second.run()
    assert second.stats["loaded_blocks"] == stored
    assert "load_failed_blocks" not in second.stats
    assert second.checked_tokens >= stored * BLOCK


# ---------------------------------------------------------------- item 3: reset_cache


def test_reset_cache_fences_kv_from_before_the_reset(make_engine) -> None:
    engine = make_engine()
    shared = prompt(23, 4 * BLOCK)
    engine.add([*shared, 1], "a")
    engine.run()
    assert engine.stats["stored_blocks"] == 4
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)

    engine.add([*shared, 2], "b")
    engine.run()
    assert "loaded_blocks" not in engine.stats  # computed again, not loaded
    assert engine.stats["stored_blocks"] == 8  # and stored anew, behind the fence

    # What this engine stored after the reset is found again ...
    assert engine.scheduler.reset_prefix_cache()
    engine.add([*shared, 3], "c")
    engine.run()
    assert engine.stats["loaded_blocks"] == 4
    # ... while an engine that did not reset still gets the blocks from before it.
    other = make_engine()
    other.add([*shared, 4], "d")
    other.run()
    assert other.stats["loaded_blocks"] == 4


def test_reset_cache_with_a_load_in_flight_says_so(make_engine, daemon) -> None:
    first = make_engine()
    shared = prompt(24, 4 * BLOCK)
    first.add([*shared, 1], "a")
    first.run()
    second = make_engine(timeout_s=60)
    second.add([*shared, *prompt(25, 2 * BLOCK), 2], "b")
    stop_daemon_at_load(second, daemon, "b")
    second.step()  # "b"'s load is in flight
    assert second.connector.reset_cache() is False
    daemon.proc.send_signal(signal.SIGCONT)
    second.run()
    # "b" computed its other blocks over KV from before the reset: none of it is stored.
    assert second.stats["loaded_blocks"] == 4
    assert "stored_blocks" not in second.stats
    assert second.connector.reset_cache() is True
    assert_scheduler_empty(second.scheduler)
    assert_daemon_holds_nothing(second, daemon)


# ---------------------------------------------------------------- item 4: streaming input


def streaming_request(tokens: list[int], req_id: str, *, resumable: bool = True, **kw) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=kw.pop("max_tokens", 3), ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
        resumable=resumable,
        **kw,
    )


def test_request_hashes_follow_vllm_when_tokens_change() -> None:
    namespaces = [Namespace("m", bytes(16), rank, 2) for rank in range(2)]
    seeds = [ns.seed for ns in namespaces]
    request = streaming_request(prompt(26, 5 * BLOCK + 3), "s")
    hashes = RequestHashes(request, seeds, BLOCK)
    assert hashes.extend_to(request, 5) == 5
    # What vLLM does to a streaming session's tokens: cut them (and its block hashes)
    # inside block 2, then append the next chunk.
    keep = 2 * BLOCK + 5
    del request._all_token_ids[keep:]
    del request.block_hashes[keep // BLOCK :]
    request._all_token_ids.extend(prompt(27, 4 * BLOCK))
    request.update_block_hashes()
    assert len(request.block_hashes) == 6

    assert hashes.extend_to(request, 6) == 6
    fresh = RequestHashes(streaming_request(list(request.all_token_ids), "t"), seeds, BLOCK)
    fresh.extend_to(request, 6)
    assert hashes.packed(0, 6) == fresh.packed(0, 6)


@pytest.mark.parametrize("store_policy", ["on_compute", "on_finish"])
def test_streaming_session_is_stored_whole(make_engine, store_policy) -> None:
    engine = make_engine(store_policy=store_policy)
    session = engine.scheduler
    first = streaming_request([*prompt(28, 3 * BLOCK), 1], "s", max_tokens=BLOCK)
    session.add_request(first)
    while first.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
        engine.step()
    # The next chunk of the session.
    session.add_request(streaming_request(prompt(29, 2 * BLOCK + 4), "s", max_tokens=4))
    while first.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
        engine.step()
    tokens = all_tokens(first)
    session.add_request(streaming_request([1], "s", resumable=False))  # the session ends
    engine.run()
    assert_scheduler_empty(engine.scheduler)

    stored = (len(tokens) - 1) // BLOCK
    second = make_engine()
    second.add([*tokens, 7], "t")
    second.run()
    assert second.stats["loaded_blocks"] == stored
    assert "load_failed_blocks" not in second.stats


# ---------------------------------------------------------------- item 6: failure policy


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_kv_load_failure_policy_must_be_recompute(daemon, model_dir, role) -> None:
    config = harness.make_vllm_config(model_dir, {"endpoint": daemon.target}, 256, "LBHNC")
    assert KVTransferConfig().kv_load_failure_policy == "fail"  # vLLM's default
    config.kv_transfer_config.kv_load_failure_policy = "fail"
    with pytest.raises(ValueError, match='"kv_load_failure_policy": "recompute"'):
        KVConnectorFactory.create_connector(
            config=config, role=role, kv_cache_config=kv_cache_config(config)
        )


# ---------------------------------------------------------------- item 7: lookups


def test_lookup_never_blocks_the_scheduler(make_engine, daemon) -> None:
    first = make_engine()
    shared = prompt(36, 4 * BLOCK)
    first.add([*shared, 1], "a")
    first.run()
    # The lookup goes as a call (as it does to a daemon on another host): no index probe.
    second = make_engine(timeout_s=60, lookup_index=False)
    with daemon.frozen():
        request = second.add([*shared, 2], "b")
        # The daemon cannot answer: the step returns all the same, with "b" left waiting.
        assert not second.step(wait_for_lookups=False)
        assert request.status == RequestStatus.WAITING
        assert second.connector.scheduler.hits.lookups_in_flight == 1
        assert not second.step(wait_for_lookups=False)
        assert second.connector.scheduler.hits.lookups_in_flight == 1
    second.run()  # once the daemon answers, "b" gets its hit
    assert second.stats["loaded_blocks"] == 4
    assert second.hit_sources == {CacheHitSource.HOST: 4 * BLOCK}
    assert second.scheduler_stats["host_hit_tokens"] == 4 * BLOCK
    assert "daemon_failures" not in second.scheduler_stats
    assert_scheduler_empty(second.scheduler)


def test_preemption_heavy_run_asks_once_per_admission(make_engine) -> None:
    # 20 blocks for 6 requests that each grow to 8: preemptions, and waiting requests that
    # cannot be admitted for many steps at the head of the queue.
    engine = make_engine(num_blocks=21)
    prompts = [[*prompt(40 + i, 4 * BLOCK), 1] for i in range(6)]
    requests = [engine.add(p, f"r{i}", max_tokens=3 * BLOCK) for i, p in enumerate(prompts)]
    engine.run()
    assert engine.preemptions >= 2
    lookup_tokens = engine.scheduler_stats["lookup_tokens"]
    # One lookup per admission: at arrival, and once per preemption (over what it holds by
    # then); never one per step. (Before: 2976 lookup tokens for these 390 prompt tokens.)
    admissions_bound = sum((1 + r.num_preemptions) * r.num_tokens for r in requests)
    assert lookup_tokens <= admissions_bound, (
        f"{lookup_tokens} lookup tokens for {sum(len(p) for p in prompts)} prompt tokens"
    )
    assert_scheduler_empty(engine.scheduler)


# ---------------------------------------------------------------- item 8: a frozen daemon


def test_the_scheduler_stops_asking_a_daemon_a_worker_found_not_answering(make_engine) -> None:
    """A worker in a process of its own whose breaker is open when it reports says so in its
    stats (``workers_unanswered``, beside the ``daemon_trips`` counter); the scheduler then
    opens its breaker too, so that the lookups it would send next do not each wait out a
    deadline of their own. A worker in the scheduler's own process shares the breaker: its
    trip is counted once and not followed twice."""
    engine = make_engine()
    side = engine.connector.scheduler
    breaker = next(iter(side.clients.values())).breaker
    report = KVTierStats(data={"daemon_trips": 1, "workers_unanswered": 1})
    side.update_connector_output(KVConnectorOutput(kv_connector_stats=report))
    assert breaker.trips == 1  # from a worker whose breaker is not this one
    wait_until(lambda: not breaker.is_open, "the probe to find the daemon answering")

    worker = engine.worker.worker
    worker.take_stats()  # what the worker counted so far
    breaker.trip("a call of the worker in this process went unanswered")
    reported = worker.take_stats()
    assert reported.data["daemon_trips"] == 1
    side.update_connector_output(KVConnectorOutput(kv_connector_stats=reported))
    assert breaker.trips == 2
    taken = (side.take_stats() or KVTierStats()).data
    assert "daemon_trips" not in taken and "workers_unanswered" not in taken  # counted once


def test_a_worker_trip_already_over_is_not_followed(make_engine) -> None:
    """A worker that tripped while the daemon restarted, and whose session reopened before
    it next reported, reports the trip but no open breaker: the daemon answers again, so the
    scheduler keeps asking it. (Following such a late report made every lookup of the next
    pass a miss: seen in CI as a restart pass without one disk hit.)"""
    engine = make_engine()
    side = engine.connector.scheduler
    breaker = next(iter(side.clients.values())).breaker
    worker = engine.worker.worker
    worker.take_stats()
    breaker.trip("the daemon restarted under a call of the worker")  # shared in one process
    wait_until(lambda: not breaker.is_open, "the probe to find the daemon answering")
    reported = worker.take_stats()
    assert reported.data == {"daemon_trips": 1}
    side.update_connector_output(KVConnectorOutput())  # a step with nothing reported
    trips = breaker.trips
    # Then the report, as from a worker in a process of its own: its breaker tripped, not
    # this one.
    side.update_connector_output(KVConnectorOutput(kv_connector_stats=reported))
    assert breaker.trips == trips and not breaker.is_open
