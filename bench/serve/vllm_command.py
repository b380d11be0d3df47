"""``kvtier bench serve --engine vllm``: the same three arms served by vLLM's CPU engine.

Each arm is a fresh vLLM engine in a process of its own (``vllm_engine``) with the same KV cache
size: the engine's prefix cache alone, then KVTierConnector on a real daemon with a host tier,
then on one with host and disk. A trace block becomes one 32-token vLLM block (``--block-tokens``
a multiple of 32), prompts are cut to the model's length, and the engine-only arm measures the
capacity the arrival times are scaled to; the kvtier arms reuse its scale, so every arm serves
the same requests at the same times. Without ``--model`` the model is a seeded random Llama
written to a temporary directory, large enough that prefill costs far more than loading KV.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

from kvtier.bench.gate.command import run_engine, write_model
from kvtier.bench.gate.engine import BLOCK_TOKENS
from kvtier.bench.serve.arms import ARMS, ArmResult, Sizes, reusable_tokens, size_tiers
from kvtier.bench.serve.loop import LoopResult, Outcome
from kvtier.bench.serve.report import compare
from kvtier.bench.serve.sample import ServeRequest
from kvtier.bench.serve.vllm_engine import ArmJob, arm_main

NOT_AVAILABLE_EXIT = 2
REQUESTS = 32
MAX_RUNNING = 8
STEP_TOKENS = 256
MAX_MODEL_LEN = 1024
"""Longest sequence of the random model's engine: prompts are cut to it (and to the model's
own limit), which keeps the KV cache every arm must have, at least one whole sequence, small."""
HIDDEN, LAYERS = 512, 8
FLOAT32_BYTES = 4


def vllm_missing() -> str | None:
    """Why ``--engine vllm`` cannot run in this Python, or None if it can."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "kvtier bench serve: --engine vllm needs vLLM importable in this Python "
            f"({sys.executable}); install vLLM (its CPU build on a machine without a GPU) "
            "or use --engine reference (nothing was measured)"
        )
    return None


def model_shape(model: str) -> tuple[int, int, int]:
    """(vocabulary, bytes of one 32-token KV block in float32, longest sequence) of ``model``."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    text = getattr(config, "text_config", None) or config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_size = getattr(text, "head_dim", None) or text.hidden_size // heads
    block_bytes = 2 * text.num_hidden_layers * kv_heads * head_size * BLOCK_TOKENS * FLOAT32_BYTES
    return text.vocab_size, block_bytes, text.max_position_embeddings


def fit(requests: list[ServeRequest], max_len: int) -> list[ServeRequest]:
    """Each request cut to ``max_len`` tokens in all: outputs first to half of it, then prompts."""
    out = []
    for r in requests:
        output = min(r.output_tokens, max_len // 2)
        out.append(replace(r, prompt=r.prompt[: max_len - output], output_tokens=output))
    return out


def run_vllm(
    args: argparse.Namespace, load_requests, calibration_stride: int, summary_base: dict
) -> dict | int:
    """Serves the three arms; the summary, or an exit status after saying why it cannot."""
    missing = vllm_missing()
    if missing is not None:
        print(missing, file=sys.stderr)
        return NOT_AVAILABLE_EXIT
    block_tokens = args.block_tokens or BLOCK_TOKENS
    if block_tokens % BLOCK_TOKENS:
        raise SystemExit(f"kvtier bench serve: --block-tokens must be a multiple of {BLOCK_TOKENS}")
    if args.clock == "engine":
        raise SystemExit("kvtier bench serve: vLLM serves in real time (--clock wall)")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-serve-", dir=args.disk_dir) as tmp:
        root = Path(tmp)
        params = None
        model = args.model
        if model is None:
            model = str(root / "model")
            params = write_model(Path(model), HIDDEN, LAYERS, args.seed)
        vocab, block_bytes, model_len = model_shape(model)
        requests = load_requests(args, block_tokens, vocab)
        longest = max(len(r.prompt) + r.output_tokens for r in requests)
        max_len = min(model_len, MAX_MODEL_LEN if args.model is None else model_len, longest)
        max_len = -(-max_len // BLOCK_TOKENS) * BLOCK_TOKENS
        requests = fit(requests, max_len)
        sizes = size_tiers(
            BLOCK_TOKENS, requests, args.gpu_blocks, args.host_blocks, args.disk_blocks
        )
        # vLLM's KV cache must hold one whole sequence and a block more.
        sizes = Sizes(
            max(sizes.gpu_blocks, max_len // BLOCK_TOKENS + 1), sizes.host_blocks, sizes.disk_blocks
        )
        base = ArmJob(
            model=model,
            max_model_len=max_len,
            kv_cache_bytes=sizes.gpu_blocks * block_bytes,
            max_num_seqs=args.max_running or MAX_RUNNING,
            step_tokens=args.step_tokens or STEP_TOKENS,
            prompts=[list(r.prompt) for r in requests],
            output_tokens=[r.output_tokens for r in requests],
            trace_arrivals_s=[r.arrival_s for r in requests],
            time_scale=args.time_scale,
            load=args.load,
            calibration_stride=calibration_stride,
        )
        results: list[ArmResult] = []
        walls: list[float] = []
        figures: dict = {}
        for name in ARMS:
            job = base
            if name != "engine-only":
                job = replace(
                    base,
                    time_scale=figures["time_scale"],
                    daemon_root=str(root / name),
                    daemon_name=f"bench-serve-{uuid.uuid4().hex[:8]}",
                    host_bytes=sizes.host_blocks * block_bytes,
                    disk_bytes=sizes.disk_blocks * block_bytes if name.endswith("disk") else 0,
                )
            started = time.perf_counter()
            arm_figures = run_engine(job, arm_main)
            if name == "engine-only":
                figures = arm_figures
            walls.append(round(time.perf_counter() - started, 1))
            results.append(arm_result(name, requests, arm_figures))
    arrivals = [r.arrival_s * figures["time_scale"] for r in requests]
    summary = summary_base | {
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "output_tokens": sum(r.output_tokens for r in requests),
        "model": args.model or f"random Llama (hidden {HIDDEN}, {LAYERS} layers, float32)",
        "model_params": params,
        "device": "cpu (vLLM)",
        "threads": None,
        "clock": "wall",
        "block_tokens": block_tokens,
        "block_size": BLOCK_TOKENS,
        "max_model_len": max_len,
        "chunk_tokens": base.step_tokens,
        "step_tokens": base.step_tokens,
        "max_running": base.max_num_seqs,
        "sizes": {
            "gpu_blocks": sizes.gpu_blocks,
            "host_blocks": sizes.host_blocks,
            "disk_blocks": sizes.disk_blocks,
        },
        "sized_from_requests": None in (args.gpu_blocks, args.host_blocks, args.disk_blocks),
        "time_scale": figures["time_scale"],
        "load": args.load,
        "engine_capacity_prompt_tokens_per_s": figures["capacity_prompt_tokens_per_s"],
        "reusable_prompt_tokens": reusable_tokens(BLOCK_TOKENS, 1, requests, arrivals),
    }
    return summary | compare(results) | {"arm_wall_s": walls, "results": results}


def arm_result(name: str, requests: list[ServeRequest], figures: dict) -> ArmResult:
    outcomes = [
        Outcome(
            done["arrival_s"],
            done["first_token_s"],
            done["finish_s"],
            len(r.prompt),
            r.output_tokens,
            0,
            0,
            0,
            done["tokens"],
            "",
        )
        for r, done in zip(requests, figures["requests"], strict=True)
    ]
    loop = LoopResult(
        outcomes,
        figures["busy_s"],
        None,
        None,
        None,
        figures["span_s"],
        figures["steps"],
        figures["max_in_flight"],
    )
    return ArmResult(name, loop, hit_tokens=figures["hit_tokens"])
