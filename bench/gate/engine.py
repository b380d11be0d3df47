"""One vLLM CPU engine of ``kvtier bench gate``, in a process of its own, and its script.

vLLM runs in this process (its EngineCore in-process), with KVTierConnector on the bench's
daemon. Each measured prompt is one request of one output token, alone in the engine, so its
time from ``generate`` to its return is its time to first token. vLLM's own prefix cache is
reset whenever the daemon restarts, and no prompt is served twice after that, so a measured
prompt's hit comes from kvtier's disk tier or nowhere.
"""

from __future__ import annotations

import os
import random
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.gate.daemon import GateDaemon

BLOCK_TOKENS = 32
"""vLLM's CPU attention wants blocks of a multiple of 32 tokens."""
VOCAB = 4096
REPEATS = 3
"""Prompts of each case; times are their median (the machine may be shared)."""
REATTACH_PROMPTS = 60
REATTACH_PAUSE_S = 0.5


@dataclass(frozen=True)
class EngineJob:
    """What one engine process runs: its model and daemon, whether the gate is on, prompts."""

    model: str
    daemon_root: str
    daemon_name: str
    host_bytes: int
    disk_bytes: int
    load_gate: bool
    crawl_ms: float
    max_model_len: int
    step_tokens: int
    prompts: dict[str, list[int]]


def enter_engine_process() -> None:
    """Readies a spawned process for vLLM's CPU engine, its EngineCore in this process."""
    os.dup2(2, 1)  # vLLM logs to stdout, which is the bench's figures
    os.environ.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
        }
    )


def engine_args(
    model: str,
    max_model_len: int,
    kv_cache_bytes: int,
    max_num_seqs: int,
    step_tokens: int,
    connector: dict[str, Any] | None,
) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for a float32 CPU engine with prefix caching and, given its
    extra config (``endpoint`` and the like), KVTierConnector."""
    args: dict[str, Any] = {
        "model": model,
        "dtype": "float32",
        "block_size": BLOCK_TOKENS,
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": kv_cache_bytes,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": step_tokens,
        "enable_prefix_caching": True,
        "enforce_eager": True,
        "disable_log_stats": False,  # kvtier's counters reach vLLM's metrics
        "skip_tokenizer_init": True,
        "seed": 0,
    }
    if connector is not None:
        args["kv_transfer_config"] = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.connector.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": connector,
        }
    return args


def child_main(job: EngineJob, conn) -> None:
    """The engine process: runs ``job``'s script and sends back ("ok", figures) or
    ("error", traceback). The daemon it started is stopped whatever happens."""
    enter_engine_process()
    daemon = GateDaemon(Path(job.daemon_root), job.host_bytes, job.disk_bytes, job.daemon_name)
    try:
        figures = (gate_on_script if job.load_gate else gate_off_script)(job, daemon)
        conn.send(("ok", figures))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        daemon.stop()
        conn.close()


class GateEngine:
    """A ``vllm.LLM`` with KVTierConnector on ``daemon``; times one prompt at a time."""

    def __init__(self, job: EngineJob, daemon: GateDaemon):
        from vllm import LLM, SamplingParams

        self.llm = LLM(
            **engine_args(
                job.model,
                job.max_model_len,
                64 << 20,
                4,
                job.step_tokens,
                {"endpoint": daemon.target, "load_gate": job.load_gate},
            )
        )
        self.params = SamplingParams(max_tokens=1, ignore_eos=True)
        self.prompts = dict(job.prompts)
        self._prompt_tokens = max(len(p) for p in job.prompts.values())
        self._rng = random.Random(len(job.prompts))
        self.daemon = daemon
        self.sessions = daemon.stats().sessions

    def ttft(self, name: str) -> dict[str, Any]:
        """Serves prompt ``name`` alone: its time to first token and its cached tokens."""
        read_before, declined_before = self.daemon.disk_blocks_read(), self.declined_tokens()
        started = time.perf_counter()
        (out,) = self.llm.generate(
            [{"prompt_token_ids": self.prompts[name]}], self.params, use_tqdm=False
        )
        return {
            "ttft_ms": round((time.perf_counter() - started) * 1000, 1),
            "cached_tokens": out.num_cached_tokens,
            "disk_blocks_read": self.daemon.disk_blocks_read() - read_before,
            "declined_disk_tokens": self.declined_tokens() - declined_before,
        }

    def declined_tokens(self) -> int:
        """``vllm:kvtier_declined_hit_tokens_total{tier="disk"}`` from vLLM's metrics."""
        return sum(
            int(metric.value)
            for metric in self.llm.get_metrics()
            if metric.name.startswith("vllm:kvtier_declined_hit_tokens")
            and metric.labels.get("tier") == "disk"
        )

    def restart_daemon(self, crawl_ms: float) -> None:
        """A restarted daemon's host tier is empty; vLLM's cache is emptied too. The engine's
        clients reconnect as it works, so fresh prompts run until all of them have."""
        self.daemon.restart(crawl_ms)
        for _ in range(REATTACH_PROMPTS):
            if self.daemon.stats().sessions >= self.sessions:
                break
            self.ttft(self._fresh())
            time.sleep(REATTACH_PAUSE_S)
        else:
            raise RuntimeError(f"the engine's {self.sessions} sessions did not come back")
        self.reset_vllm_cache()

    def reset_vllm_cache(self) -> None:
        """Empties vLLM's prefix cache. It refuses while blocks are held, as they are for
        stores still in flight; a prompt shorter than a block stores nothing, and its steps
        let the engine take the finished stores and free their blocks."""
        short = [{"prompt_token_ids": self.prompts["warm-0"][: BLOCK_TOKENS // 2]}]
        for _ in range(REATTACH_PROMPTS):
            if self.llm.reset_prefix_cache():
                return
            self.llm.generate(short, self.params, use_tqdm=False)
            time.sleep(REATTACH_PAUSE_S)
        raise RuntimeError("vLLM's prefix cache could not be reset")

    def _fresh(self) -> str:
        """The name of a new prompt no tier holds."""
        name = f"filler-{len(self.prompts)}"
        self.prompts[name] = [self._rng.randrange(3, VOCAB) for _ in range(self._prompt_tokens)]
        return name

    def hit_planner(self):
        """The connector's scheduler side (in this process: EngineCore runs in-process)."""
        core = self.llm.llm_engine.engine_core.engine_core
        return core.scheduler.connector.scheduler.hits

    def gate_figures(self) -> dict[str, Any]:
        """The gate's estimates now, in tokens per second."""
        hits = self.hit_planner()
        disk = hits.watch.read_bytes_per_s.get("disk")
        prefill = hits.gate.prefill_tokens_per_s
        return {
            "prefill_tokens_per_s": None if prefill is None else round(prefill),
            "disk_tokens_per_s": None if disk is None else round(disk / hits.gate.bytes_per_token),
        }

    def learn_disk_rate(self, probe: str) -> dict[str, Any]:
        """Serves ``probe`` (a disk hit: the daemon measures its reads) and waits for the
        connector to read the daemon's new disk rate."""
        figures = self.ttft(probe)
        self.hit_planner().watch.refresh(timeout=60)
        return figures


def summary(runs: list[dict[str, Any]], recomputes: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeated prompts of one case: the median time, the median ratio of each one's time to
    the recompute served beside it (which a shared machine's load shifts alike), and what
    each run got."""
    return {
        "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
        "vs_recompute": round(
            statistics.median(
                r["ttft_ms"] / f["ttft_ms"] for r, f in zip(runs, recomputes, strict=True)
            ),
            3,
        ),
        "cached_tokens": [r["cached_tokens"] for r in runs],
        "disk_blocks_read": sum(r["disk_blocks_read"] for r in runs),
        "declined_disk_tokens": sum(r["declined_disk_tokens"] for r in runs),
        "runs_ms": [r["ttft_ms"] for r in runs],
    }


def gate_on_script(job: EngineJob, daemon: GateDaemon) -> dict[str, Any]:
    """Fast disk then crawling disk, gate on: recompute, (a) and (c), turn about."""
    daemon.start(0.0)
    engine = GateEngine(job, daemon)
    stored = ["warm-0", "warm-1", "probe-fast", "probe-crawl"]
    stored += [f"{case}-{i}" for case in ("fast", "crawl", "crawl-off") for i in range(REPEATS)]
    for name in stored:
        engine.ttft(name)  # each one computed and stored, on disk alone after the restart
    engine.restart_daemon(0.0)
    out: dict[str, Any] = {"probe_fast": engine.learn_disk_rate("probe-fast")}
    out["gate_fast"] = engine.gate_figures()
    fresh, fast = [], []
    for i in range(REPEATS):
        fresh.append(engine.ttft(f"fresh-{i}"))
        fast.append(engine.ttft(f"fast-{i}"))
    engine.restart_daemon(job.crawl_ms)
    out["probe_crawl"] = engine.learn_disk_rate("probe-crawl")
    out["gate_crawl"] = engine.gate_figures()
    crawl = []
    for i in range(REPEATS):
        crawl.append(engine.ttft(f"crawl-{i}"))
        fresh.append(engine.ttft(f"fresh-{REPEATS + i}"))
    out["recompute"] = summary(fresh, fresh)
    out["fast_disk_gate_on"] = summary(fast, fresh[:REPEATS])
    out["crawling_disk_gate_on"] = summary(crawl, fresh[REPEATS:])
    return out


def gate_off_script(job: EngineJob, daemon: GateDaemon) -> dict[str, Any]:
    """Crawling disk, gate off: (b), turn about with this engine's own recomputes. A load
    the connector gave up on goes on reading in the daemon; the next prompt waits it out."""
    daemon.start(job.crawl_ms)
    engine = GateEngine(job, daemon)
    for name in ("warm-2", "warm-3"):
        engine.ttft(name)
    fresh, crawl = [], []
    for i in range(REPEATS):
        fresh.append(engine.ttft(f"fresh-{2 * REPEATS + i}"))
        crawl.append(engine.ttft(f"crawl-off-{i}"))
        daemon.wait_reads_idle()
    return {"recompute": summary(fresh, fresh), "crawling_disk_gate_off": summary(crawl, fresh)}
