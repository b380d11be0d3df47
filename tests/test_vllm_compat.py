"""The connector on every current vLLM: what each release changed (``compat``), what 0.34
added that kvtier uses, and a vLLM newer than the connector knows costing hits, never the
engine's step.

Runs on vLLM 0.33.0 and 0.34.0 (``tests/run.sh`` makes both environments): a test of what only
one of them has says so and is skipped on the other.
``CUDA_VISIBLE_DEVICES= VLLM_TARGET_DEVICE=cpu pytest -m vllm tests/test_vllm_compat.py``.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request, RequestStatus

from kvtier.connector.vllm import compat

import vllmdaemon
import vllmharness as harness
from tinymodel import BLOCK
from vllmharness import assert_scheduler_empty, prompt

pytestmark = pytest.mark.vllm

_none_hash = harness._none_hash
model_dir = harness.model_dir
make_engine = harness.make_engine
daemon = vllmdaemon.daemon


class Without:
    """``obj`` less the attribute ``name`` (as a vLLM that renamed it would hand it over),
    with ``replaced`` attributes in place of its own."""

    def __init__(self, obj, name: str = "", **replaced):
        self._obj = obj
        self._name = name
        self._replaced = replaced

    def __getattr__(self, attr: str):
        if attr == self._name:
            raise AttributeError(f"{type(self._obj).__name__!r} object has no attribute {attr!r}")
        if attr in self._replaced:
            return self._replaced[attr]
        return getattr(self._obj, attr)


def mismatches(engine) -> int:
    """Mismatches the engine's scheduler connector counted and has not reported yet."""
    return engine.connector.scheduler.stats.data.get("vllm_mismatches", 0)


def stored_prefix(make_engine, seed: int, blocks: int) -> list[int]:
    """A prompt prefix of ``blocks`` blocks that a first engine stored in the daemon."""
    shared = prompt(seed, blocks * BLOCK)
    first = make_engine()
    first.add([*shared, 1], "first")
    first.run()
    assert first.stats["stored_blocks"] == blocks
    return shared


def drifting(engine, name: str) -> None:
    """Hands the engine's connector scheduler outputs whose ``name`` is gone."""
    build = engine.connector.build_connector_meta
    engine.connector.build_connector_meta = lambda out: build(Without(out, name))


def test_a_step_whose_output_lacks_a_field_survives_counted_and_logged(make_engine, caplog):
    shared = stored_prefix(make_engine, 41, 4)
    engine = make_engine()
    drifting(engine, "scheduled_cached_reqs")
    caplog.set_level(logging.ERROR, logger=compat.__name__)
    engine.add([*shared, 2], "promised")  # its load is planned before the step's output is read
    engine.step()
    engine.add([*prompt(43, 3 * BLOCK), 5], "after")
    engine.add([*shared, 3], "would-hit")
    engine.run()
    # The load promised to vLLM was served and read back intact by the fake forward pass.
    assert engine.stats["loaded_blocks"] == 4
    # From then on the connector cannot tell which block holds what: no hit, no store.
    assert "stored_blocks" not in engine.stats
    assert engine.scheduler_stats["vllm_mismatches"] >= 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert "build_connector_meta" in errors[0] and compat.vllm_version() in errors[0]
    assert_scheduler_empty(engine.scheduler)


def test_a_request_lacking_a_field_the_lookup_reads_is_a_counted_miss(make_engine):
    shared = stored_prefix(make_engine, 45, 2)
    engine = make_engine()
    request = engine.add([*shared, 2], "a")
    connector = engine.connector
    assert connector.get_num_new_matched_tokens(Without(request, "prompt_embeds"), 0) == (0, False)
    assert mismatches(engine) == 1 and not connector.scheduler.drift.lost_track
    engine.run()  # the request itself, read whole, still hits
    assert engine.stats["loaded_blocks"] == 2


def request_of(tokens: list[int], req_id: str, **params) -> Request:
    """A vLLM request of ``tokens``, with ``params`` of its sampling."""
    return Request(
        request_id=req_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=3, ignore_eos=True, **params),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def test_a_vllm_whose_block_ids_cannot_be_read_is_offered_no_hit(
    make_engine, daemon, model_dir, monkeypatch
):
    shared = stored_prefix(make_engine, 49, 2)
    monkeypatch.delattr(KVCacheBlocks, "get_block_ids")
    config = harness.make_vllm_config(model_dir, {"endpoint": daemon.target}, 256, "LBHNC")
    connector = KVConnectorFactory.create_connector(
        config=config,
        role=KVConnectorRole.SCHEDULER,
        kv_cache_config=harness.kv_cache_config(config),
    )
    try:
        request = request_of([*shared, 2], "a")
        connector.on_new_request(request)
        # The daemon holds the prefix, but a hit could not be loaded into vLLM's blocks.
        assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
        assert connector.scheduler.drift.lost_track
    finally:
        connector.shutdown()


def test_a_scheduler_output_without_resumed_req_ids_never_raises(make_engine):
    """vLLM 0.34 removed ``resumed_req_ids``; a preemption-heavy run hands the connector
    outputs without it on any vLLM."""
    engine = make_engine(num_blocks=12)
    build = engine.connector.build_connector_meta
    engine.connector.build_connector_meta = lambda out: build(
        Without(out, scheduled_cached_reqs=Without(out.scheduled_cached_reqs, "resumed_req_ids"))
    )
    for i in range(4):
        engine.add([*prompt(47 + i, 3 * BLOCK), 1], f"r{i}", max_tokens=40)
    engine.run()
    assert engine.preemptions > 0
    assert_scheduler_empty(engine.scheduler)
    if not compat._RESUMED_IN_CACHED:
        assert "vllm_mismatches" not in engine.scheduler_stats and mismatches(engine) == 0


def test_a_request_that_may_not_read_external_kv_is_never_looked_up(make_engine):
    shared = stored_prefix(make_engine, 51, 4)
    engine = make_engine()
    engine.scheduler.add_request(request_of([*shared, 2], "b", skip_reading_prefix_cache=True))
    engine.run()
    assert "lookup_tokens" not in engine.scheduler_stats
    assert "loaded_blocks" not in engine.stats
    assert_scheduler_empty(engine.scheduler)


@pytest.mark.skipif(
    not hasattr(KVConnectorBase_V1, "may_load_async"),
    reason="vLLM before 0.34 has no --max-num-inflight-kv-loads",
)
def test_an_async_hit_starts_loading_while_the_batch_is_full(make_engine):
    shared = stored_prefix(make_engine, 61, 4)
    engine = make_engine(scheduler={"max_num_seqs": 1, "max_num_inflight_kv_loads": 1})
    engine.add([*prompt(62, 2 * BLOCK), 1], "running", max_tokens=20)
    engine.step()
    request = engine.add([*shared, 2], "hit")
    assert engine.connector.may_load_async(request)
    engine.step()
    # The one running slot is taken, yet the hit's load is under way.
    assert engine.scheduler.requests["running"].status == RequestStatus.RUNNING
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.run()
    assert engine.stats["loaded_blocks"] == 4
    assert_scheduler_empty(engine.scheduler)
