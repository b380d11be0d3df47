"""vLLM releasing the KV cache's memory under the worker (``unregister_kv_caches`` before sleep
or a weight update, ``restore_kv_caches`` after; vLLM 0.34's extensible KV cache does this on
CUDA): kvtier drains every store and load first, copies nothing while the memory is gone,
and copies again, into the right blocks, once it is back.

The memory is "released" here by overwriting every page (what a recommitted page holds is
not the old blocks); the fake forward pass checks every byte a load brings back. The CUDA side
(the same calls over device memory) is ``test_cuda_kv_memory.py``, in the suite for a GPU machine.
``CUDA_VISIBLE_DEVICES= VLLM_TARGET_DEVICE=cpu pytest -m vllm tests/test_vllm_kv_memory.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllmdaemon
import vllmharness as harness
from tinymodel import BLOCK
from vllmharness import assert_scheduler_empty, prompt

pytestmark = pytest.mark.vllm

_none_hash = harness._none_hash
model_dir = harness.model_dir
make_engine = harness.make_engine
daemon = vllmdaemon.daemon


def release_memory(engine) -> None:
    """What vLLM's release and recommit leave in the pages: none of the old blocks."""
    for tensor in engine.kv_caches.values():
        tensor.fill_(-7.0)


def test_stores_are_drained_before_release_and_loads_land_after_restore(make_engine, daemon):
    engine = make_engine()
    shared = prompt(71, 4 * BLOCK)
    engine.add([*shared, 1], "a", max_tokens=1)
    engine.step()
    worker = engine.worker.worker
    assert worker.deferred_stores > 0  # the step's stores start with the next step

    engine.worker.unregister_kv_caches()
    assert worker.deferred_stores == 0
    assert worker.in_flight == 0
    assert not worker.engines  # no copy may touch the memory now
    engine.worker.unregister_kv_caches()  # vLLM may call it again
    release_memory(engine)
    engine.worker.restore_kv_caches()
    engine.worker.restore_kv_caches()
    assert set(worker.engines) == {0}

    engine.run()
    assert engine.stats["stored_blocks"] == 4  # stored from the blocks before the release
    # vLLM forgets its own prefix cache with the memory; a request after the restore loads
    # the blocks from kvtier into the restored memory, every byte checked.
    assert engine.scheduler.reset_prefix_cache()
    engine.add([*shared, 2], "b")
    engine.run()
    assert engine.stats["loaded_blocks"] == 4
    assert_scheduler_empty(engine.scheduler)
    vllmdaemon.assert_daemon_holds_nothing(engine, daemon)


def test_an_async_load_under_way_lands_before_release(make_engine):
    shared = prompt(73, 4 * BLOCK)
    first = make_engine()
    first.add([*shared, 1], "a")
    first.run()
    engine = make_engine()
    request = engine.add([*shared, 2], "b")
    engine.step()  # the async load starts: its acquire goes out on the worker's helper thread
    engine.worker.unregister_kv_caches()
    worker = engine.worker.worker
    assert worker.in_flight == 0
    assert all(load.landed for load in worker._loads())
    engine.worker.restore_kv_caches()
    engine.run()  # whatever landed is read back intact; whatever was given up is recomputed
    assert request.is_finished()
    assert_scheduler_empty(engine.scheduler)
