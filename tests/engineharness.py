"""The real-engine tests' harness (``test_vllm_engine``): engines with KVTierConnector in
four configurations, each with a daemon of its own, the passes they run and the counters a
pass moved, and the baselines (engines without kvtier) their outputs are compared with."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from daemonutil import Daemon, daemon_stats, free_port, wait_until
from engineworkloads import ABORT_WORKLOADS, BLOCK, PROBE, WORKLOADS, Workload
from eventutil import Router, events_config
from llmutil import (
    EngineError,
    EngineProcess,
    EngineSpec,
    kvtier_transfer_config,
    tiny_llama_config,
    write_random_model,
)

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
prefix): the pass is under way, its last request (``start_held_pass``) still to come."""


# ---------------------------------------------------------------- counters


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


def request_ids(workload: str) -> list[str]:
    """The ids a held pass gives its requests, in prompt order."""
    return [f"{workload}-{i}" for i in range(len(WORKLOADS[workload].prompts))]


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
        start = self.marks()
        self.engine.send("generate", w.prompts, w.max_tokens)
        return start

    def start_held_pass(self, workload: str) -> PassStart:
        """Starts a pass that cannot end before ``release``: its last request is added only
        then, so a fault the test makes before it lands in a pass still under way however fast
        the engine runs."""
        start = self.marks()
        requests = WORKLOADS[workload].requests()
        for req_id, request in zip(request_ids(workload), requests[:-1], strict=False):
            self.engine.add(req_id, *request)
        return start

    def release(self, workload: str) -> None:
        """Adds a held pass's last request; ``finish_pass`` then collects the pass."""
        req_ids = request_ids(workload)
        self.engine.add(req_ids[-1], *WORKLOADS[workload].requests()[-1])
        self.engine.send("finish", req_ids)

    def marks(self) -> PassStart:
        """The counters a pass starts from."""
        return PassStart(
            self.engine.metrics(), self.daemon_reads(), time.monotonic(), self.daemon_pid()
        )

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

    def wait_written(self) -> None:
        """Waits until every block the daemon committed is on its disk tier too (nothing left
        writing behind), so that what a later kill may take is only what comes after."""
        wait_until(
            lambda: all(
                layout["writing_behind"] == 0 for layout in daemon_stats(self.daemon)["layouts"]
            ),
            "the disk tier's writes behind",
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


@pytest.fixture(autouse=True)
def no_call_left_in_flight(request) -> Iterator[None]:
    """Collects the pass a failed test left running, so the next test starts on an idle
    engine instead of failing on the call in flight."""
    yield
    if "kvtier" in request.fixturenames:
        engine = request.getfixturevalue("kvtier").engine
        if engine.in_flight() is not None:
            with contextlib.suppress(EngineError):
                engine.receive(HANG_GUARD_S)


def assert_identical(name: str, got: list[list[int]], want: list[list[int]]) -> None:
    differ = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    print(f"{name}: outputs identical {len(got) - len(differ)}/{len(got)}")
    assert not differ, (
        f"{name}: outputs of prompts {differ} differ; first: {got[differ[0]]} != {want[differ[0]]}"
    )
