"""One arm of ``kvtier bench serve --engine vllm``: a vLLM CPU engine in a process of its own.

The process starts the arm's daemon (none for the engine-only arm), builds vLLM's engine with
KVTierConnector on it, warms the engine up on a prompt no request shares, and serves the
requests in wall time: each one is added to the engine when its arrival time has passed, and
the engine steps while any request is unfinished. A request's first token exists when the step
that produced it returns; its time to first token runs from its arrival. The engine-only arm,
when asked, first measures what the engine sustains (``calibrate``) and derives the arrival
times from it; it then empties vLLM's prefix cache, so the timed run starts cold as every arm's.
"""

from __future__ import annotations

import random
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.gate.daemon import GateDaemon
from kvtier.bench.gate.engine import VOCAB, engine_args, enter_engine_process

WARMUP_SEED = 7919
TIERS = ("host", "disk")


@dataclass(frozen=True)
class ArmJob:
    """What one arm's engine process serves, on what engine and daemon."""

    model: str
    max_model_len: int
    kv_cache_bytes: int
    max_num_seqs: int
    step_tokens: int
    prompts: list[list[int]]
    output_tokens: list[int]
    trace_arrivals_s: list[float]
    time_scale: float | None
    """The factor on trace arrival times; None: measure the engine and derive it."""
    load: float
    calibration_stride: int
    daemon_root: str | None = None
    """The arm's daemon's directory; None: no daemon, the engine's prefix cache alone."""
    daemon_name: str = ""
    host_bytes: int = 0
    disk_bytes: int = 0


def arm_main(job: ArmJob, conn) -> None:
    """The arm's process: sends back ("ok", figures) or ("error", traceback). The daemon it
    started is stopped whatever happens."""
    enter_engine_process()
    daemon = None
    try:
        connector = None
        if job.daemon_root is not None:
            daemon = GateDaemon(
                Path(job.daemon_root), job.host_bytes, job.disk_bytes, job.daemon_name
            )
            daemon.start()
            connector = {"endpoint": daemon.target}
        conn.send(("ok", serve_arm(job, connector)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        if daemon is not None:
            daemon.stop()
        conn.close()


def serve_arm(job: ArmJob, connector: dict[str, Any] | None) -> dict[str, Any]:
    from vllm import LLM

    llm = LLM(
        **engine_args(
            job.model,
            job.max_model_len,
            job.kv_cache_bytes,
            job.max_num_seqs,
            job.step_tokens,
            connector,
        )
    )
    engine = llm.llm_engine
    rng = random.Random(WARMUP_SEED)
    warmup = [[rng.randrange(3, VOCAB) for _ in range(job.max_model_len // 2)]]
    serve(engine, warmup, [1], [0.0], "warmup")
    scale, capacity = job.time_scale, None
    if scale is None:
        capacity = calibrate(engine, job)
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM's prefix cache could not be emptied after measuring")
        scale = time_scale(job.prompts, job.trace_arrivals_s, job.load, capacity)
    arrivals = [t * scale for t in job.trace_arrivals_s]
    before = hit_counters(llm)
    figures = serve(engine, job.prompts, job.output_tokens, arrivals, "request")
    after = hit_counters(llm)
    figures["hit_tokens"] = {tier: after[tier] - before[tier] for tier in after}
    figures["time_scale"] = scale
    figures["capacity_prompt_tokens_per_s"] = capacity
    return figures


def calibrate(engine, job: ArmJob) -> float:
    """Prompt tokens per busy second with every ``calibration_stride``-th request offered at
    once (the engine always has work, as at saturation)."""
    picked = range(0, len(job.prompts), job.calibration_stride)
    prompts = [job.prompts[i] for i in picked]
    figures = serve(engine, prompts, [job.output_tokens[i] for i in picked], [0.0] * len(prompts))
    return sum(map(len, prompts)) / max(figures["busy_s"], 1e-9)


def time_scale(
    prompts: list[list[int]], trace_arrivals_s: list[float], load: float, capacity: float
) -> float:
    """The factor on trace times that offers ``load`` of ``capacity`` prompt tokens/s."""
    span = max(trace_arrivals_s) - min(trace_arrivals_s)
    if span <= 0:
        return 1.0
    return sum(map(len, prompts)) / (load * capacity) / span


def serve(
    engine,
    prompts: list[list[int]],
    output_tokens: list[int],
    arrivals_s: list[float],
    prefix: str = "calibrate",
) -> dict[str, Any]:
    """Serves the prompts in wall time, prompt ``i`` added once ``arrivals_s[i]`` seconds have
    passed; each request's times (seconds from the start) and tokens, and the time spent in
    steps."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    order = sorted(range(len(prompts)), key=lambda i: arrivals_s[i])
    first: dict[int, float] = {}
    finish: dict[int, float] = {}
    tokens: dict[int, list[int]] = {i: [] for i in order}
    busy = 0.0
    steps = 0
    in_flight = max_in_flight = 0
    start = time.perf_counter()
    while order or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while order and arrivals_s[order[0]] <= now:
            i = order.pop(0)
            params = SamplingParams(
                max_tokens=output_tokens[i],
                ignore_eos=True,
                temperature=0.0,
                output_kind=RequestOutputKind.DELTA,
            )
            engine.add_request(f"{prefix}-{i}", {"prompt_token_ids": prompts[i]}, params)
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals_s[order[0]] - (time.perf_counter() - start)))
            continue
        stepped = time.perf_counter()
        outputs = engine.step()
        ended = time.perf_counter()
        busy += ended - stepped
        steps += 1
        for out in outputs:
            i = int(out.request_id.rsplit("-", 1)[1])
            tokens[i].extend(out.outputs[0].token_ids)
            if tokens[i] and i not in first:
                first[i] = ended - start
            if out.finished:
                finish[i] = ended - start
        in_flight -= sum(1 for out in outputs if out.finished)
    missing = [i for i in range(len(prompts)) if i not in finish]
    assert not missing, f"requests {missing} never finished"
    return {
        "requests": [
            {
                "arrival_s": arrivals_s[i],
                "first_token_s": first[i],
                "finish_s": finish[i],
                "tokens": tokens[i],
            }
            for i in range(len(prompts))
        ],
        "busy_s": busy,
        "span_s": max(finish.values(), default=0.0) - min(arrivals_s, default=0.0),
        "steps": steps,
        "max_in_flight": max_in_flight,
    }


def hit_counters(llm) -> dict[str, int]:
    """Prompt tokens served from vLLM's own prefix cache (``gpu``) and from each kvtier tier,
    from vLLM's metrics, counted once per request as it is scheduled."""
    counts = dict.fromkeys(("gpu", *TIERS), 0)
    for metric in llm.get_metrics():
        source = metric.labels.get("source")
        if metric.name.startswith("vllm:prompt_tokens_by_source") and source == "local_cache_hit":
            counts["gpu"] += int(metric.value)
        for tier in TIERS:
            if metric.name.startswith(f"vllm:kvtier_{tier}_hit_tokens"):
                counts[tier] += int(metric.value)
    return counts
