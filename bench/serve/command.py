"""``kvtier bench serve``: a timed trace served by a real engine loop, with and without kvtier.

Whole conversations are sampled from the trace (``sample``), each trace block shrunk to
``--block-tokens`` tokens, and served by the reference engine with continuous batching
(``loop``) in three arms on the same GPU pool size (``arms``): the engine's prefix cache alone,
then kvtier's host tier behind it, then host and disk. Arrival times are the trace's, scaled so
that the offered load is ``--load`` of what the engine-only arm sustains, measured first by
offering it a sixth of the requests at once (more of a small sample: enough for two full
batches where it has them). Each arm reports time to first token and
throughput (``report``); ``--plot`` draws the TTFT distributions (``plot``). ``--engine vllm``
serves the same arms through vLLM's engine instead (``vllm_command``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch

from kvtier.bench.replay.trace import load_trace
from kvtier.bench.replay.workloads import WORKLOADS
from kvtier.bench.serve.arms import (
    ARMS,
    ServeSetup,
    Sizes,
    engine_capacity,
    reusable_tokens,
    run_arms,
    size_tiers,
)
from kvtier.bench.serve.clock import CLOCKS
from kvtier.bench.serve.plot import plot_ttft_cdf
from kvtier.bench.serve.report import compare, print_text, ttfts_ms
from kvtier.bench.serve.sample import ServeRequest, sample_conversations, to_serve_requests
from kvtier.bench.serve.vllm_command import REQUESTS as VLLM_REQUESTS
from kvtier.bench.serve.vllm_command import run_vllm
from kvtier.engine.config import ModelConfig
from kvtier.engine.model import Decoder

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16
CALIBRATION_STRIDE = 6
REQUESTS = 320
MODELS = {
    "small": lambda: ModelConfig(
        vocab_size=4096,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        intermediate_size=768,
    ),
    "tiny": ModelConfig.tiny,
    "1b": ModelConfig.llama_1b,
}
"""Reference-engine models: ``small`` (5M parameters, float32) for CPUs, where its prefill
still costs far more per token than loading KV; ``1b`` (Llama 3.2 1B's shape, bf16) for GPUs;
``tiny`` for tests."""
DEFAULTS = {
    # device: (model, block tokens, chunk blocks, step tokens, requests in flight)
    "cpu": ("small", 16, 2, 256, 8),
    "cuda": ("1b", 128, 8, 2048, 32),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="JSON-lines trace (Mooncake format, 512-token blocks)")
    source.add_argument("--workload", choices=sorted(WORKLOADS), help="seeded synthetic trace")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample and --workload")
    parser.add_argument(
        "--requests",
        type=int,
        help="whole conversations sampled up to N requests (default 320; 32 with vLLM)",
    )
    parser.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default="reference",
        help="the serving engine (vllm: its CPU build or GPU build, importable here)",
    )
    parser.add_argument(
        "--model",
        help=f"reference engine: one of {', '.join(sorted(MODELS))} (default: small on a "
        "CPU, 1b on a GPU); vllm: a Hugging Face model directory or id (default: a random "
        "Llama written to a temporary directory)",
    )
    parser.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch (default 1: steadier on a machine shared with others)",
    )
    parser.add_argument(
        "--block-tokens", type=int, help="tokens per 512-token trace block (16 CPU, 128 GPU)"
    )
    parser.add_argument("--chunk-blocks", type=int, help="prefill chunk in 16-token blocks")
    parser.add_argument("--step-tokens", type=int, help="token budget of one engine step")
    parser.add_argument(
        "--max-running", type=int, help="requests in flight at most (default 8 CPU, 32 GPU)"
    )
    parser.add_argument("--gpu-blocks", type=int, help="GPU pool (default: 5%% of blocks)")
    parser.add_argument("--host-blocks", type=int, help="host tier (default: 30%% of blocks)")
    parser.add_argument("--disk-blocks", type=int, help="disk tier (default: all blocks)")
    parser.add_argument(
        "--load",
        type=float,
        default=0.9,
        help="offered load as a share of the engine-only arm's measured capacity (default 0.9)",
    )
    parser.add_argument(
        "--time-scale", type=float, help="multiply trace arrival times by this (skips measuring)"
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        help="engine: the engine thread's own time, idle time skipped (default on a CPU); "
        "wall: real time (default on a GPU)",
    )
    parser.add_argument("--disk-dir", help="where the disk tier's temporary directory goes")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the TTFT CDF per arm")


def load_requests(args: argparse.Namespace, block_tokens: int, vocab: int) -> list[ServeRequest]:
    trace = load_trace(args.trace) if args.trace else WORKLOADS[args.workload](args.seed)
    limit = args.requests or (VLLM_REQUESTS if args.engine == "vllm" else REQUESTS)
    sampled = sample_conversations(trace, limit, args.seed)
    if not sampled:
        raise SystemExit(f"kvtier bench serve: no conversation fits in {limit} requests")
    return to_serve_requests(sampled, block_tokens, vocab)


def calibration_sample(requests: list[ServeRequest], max_running: int) -> list[ServeRequest]:
    """The requests offered at once to measure the engine's capacity: every
    ``CALIBRATION_STRIDE``-th, or more where that would leave fewer than two full batches
    (``max_running`` each). A step costs about the same for one decoding request as for a
    full batch, so a batch kept short would measure the engine far below its rate."""
    stride = max(1, min(CALIBRATION_STRIDE, len(requests) // (2 * max_running)))
    return requests[::stride]


def time_scale(
    args: argparse.Namespace, setup: ServeSetup, sizes: Sizes, requests: list[ServeRequest]
) -> tuple[float, float | None]:
    """The factor on trace times, and the engine-only capacity it came from (if measured)."""
    if args.time_scale is not None:
        return args.time_scale, None
    started = time.perf_counter()
    capacity = engine_capacity(setup, sizes, calibration_sample(requests, setup.max_running))
    logger.info(
        "engine-only capacity: %.0f prompt tokens/s (measured in %.1f s)",
        capacity,
        time.perf_counter() - started,
    )
    arrivals = [r.arrival_s for r in requests]
    trace_span = max(arrivals) - min(arrivals)
    if trace_span <= 0:
        return 1.0, capacity
    prompt = sum(len(r.prompt) for r in requests)
    return prompt / (args.load * capacity) / trace_span, capacity


def run(args: argparse.Namespace) -> int:
    if not 0 < args.load <= 1:
        raise SystemExit(f"kvtier bench serve: --load must be in (0, 1], got {args.load}")
    if args.engine == "vllm":
        return _run_vllm(args)
    threads = torch.get_num_threads()
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type not in DEFAULTS:
        raise SystemExit(f"kvtier bench serve: runs on {' or '.join(DEFAULTS)}, not {device}")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    clock = args.clock or ("engine" if device.type == "cpu" else "wall")
    if clock == "engine" and (device.type != "cpu" or torch.get_num_threads() != 1):
        raise SystemExit(
            "kvtier bench serve: --clock engine counts one CPU thread's time; it needs "
            "--device cpu and --threads 1 (or use --clock wall)"
        )
    model_name, block_tokens, chunk_blocks, step_tokens, max_running = DEFAULTS[device.type]
    model_name = args.model or model_name
    if model_name not in MODELS:
        raise SystemExit(
            f"kvtier bench serve: the reference engine's --model is one of "
            f"{', '.join(sorted(MODELS))}, not {model_name!r}"
        )
    block_tokens = args.block_tokens or block_tokens
    if block_tokens % BLOCK_SIZE:
        raise SystemExit(f"kvtier bench serve: --block-tokens must be a multiple of {BLOCK_SIZE}")
    config = MODELS[model_name]()
    requests = load_requests(args, block_tokens, config.vocab_size)
    setup = ServeSetup(
        Decoder(config, device),
        BLOCK_SIZE,
        args.chunk_blocks or chunk_blocks,
        args.max_running or max_running,
        args.step_tokens or step_tokens,
        CLOCKS[clock],
        args.disk_dir,
    )
    sizes = size_tiers(BLOCK_SIZE, requests, args.gpu_blocks, args.host_blocks, args.disk_blocks)
    logger.info("%d requests; tiers %s", len(requests), sizes)
    scale, capacity = time_scale(args, setup, sizes, requests)
    arrivals = [r.arrival_s * scale for r in requests]
    arms_started = time.perf_counter()
    results = run_arms(ARMS, setup, sizes, requests, arrivals)
    logger.info("%d arms served in %.1f s", len(ARMS), time.perf_counter() - arms_started)
    summary: dict[str, object] = {
        "source": _source(args),
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "output_tokens": sum(r.output_tokens for r in requests),
        "engine": args.engine,
        "model": model_name,
        "model_params": config.num_params,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "clock": clock,
        "block_tokens": block_tokens,
        "block_size": BLOCK_SIZE,
        "chunk_tokens": setup.chunk_blocks * BLOCK_SIZE,
        "step_tokens": setup.step_tokens,
        "max_running": setup.max_running,
        "sizes": {
            "gpu_blocks": sizes.gpu_blocks,
            "host_blocks": sizes.host_blocks,
            "disk_blocks": sizes.disk_blocks,
        },
        "sized_from_requests": None in (args.gpu_blocks, args.host_blocks, args.disk_blocks),
        "time_scale": scale,
        "load": args.load,
        "engine_capacity_prompt_tokens_per_s": capacity,
        "reusable_prompt_tokens": reusable_tokens(
            BLOCK_SIZE, setup.chunk_blocks, requests, arrivals
        ),
    }
    summary |= compare(results)
    return _report(args, summary, results, started)


def _run_vllm(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    base = {"source": _source(args), "engine": "vllm"}
    summary = run_vllm(args, load_requests, CALIBRATION_STRIDE, base)
    if isinstance(summary, int):
        return summary
    return _report(args, summary, summary.pop("results"), started)


def _source(args: argparse.Namespace) -> str:
    return args.trace or f"{args.workload} (seed {args.seed})"


def _report(args: argparse.Namespace, summary: dict, results: list, started: float) -> int:
    if args.plot:
        plot_ttft_cdf(args.plot, str(summary["source"]), [(r.name, ttfts_ms(r)) for r in results])
        summary["plot"] = args.plot
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_text(summary)
    return 0
