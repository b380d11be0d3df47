"""``kvtier bench gate``: the load-or-recompute gate on a real vLLM CPU engine and a real daemon.

A hit is worth loading only if it arrives before the engine could compute it again. This
serves prompts whose KV lies on kvtier's disk tier alone (the daemon restarted on its data
directory, vLLM's prefix cache reset) through vLLM's CPU engine with KVTierConnector, and
times each one's first token:

* ``recompute``: a prompt of the same length that no tier holds;
* ``fast_disk_gate_on``: a disk hit on the plain disk, the gate on: the hit should be taken;
* ``crawling_disk_gate_off``: a disk hit with every disk read delayed ``--crawl-ms`` (the
  daemon's ``--disk-read-delay-ms``), the gate off: the slow load is waited for, up to the
  connector's acquire deadline, after which the prompt is recomputed;
* ``crawling_disk_gate_on``: the same crawl, the gate on: the hit should be declined and the
  prompt recomputed, at about the recompute time.

Before each disk's measured hits a short probe prompt's disk hit lets the daemon measure that
disk and the connector read its rate (until the gate knows a rate it takes every hit). Two engine
processes run one after the other (gate on, then gate off; ``--engines gate-on`` runs the
first alone), each on the same daemon data directory. Needs vLLM (its CPU build) importable;
the model is a seeded random Llama written here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtier.bench.gate.engine import BLOCK_TOKENS, REPEATS, VOCAB, EngineJob, child_main

NOT_AVAILABLE_EXIT = 2
ENGINE_TIMEOUT_S = 900.0
PROBE_BLOCKS = 4
PROMPT_NAMES = (
    *(f"warm-{i}" for i in range(4)),
    *(f"fresh-{i}" for i in range(3 * REPEATS)),
    *(f"{case}-{i}" for case in ("fast", "crawl", "crawl-off") for i in range(REPEATS)),
    "probe-fast",
    "probe-crawl",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt-tokens", type=int, default=1024, help="tokens of every prompt (default 1024)"
    )
    parser.add_argument(
        "--crawl-ms",
        type=float,
        default=300.0,
        help="delay of every disk block read on the crawling disk (default 300 ms)",
    )
    parser.add_argument("--hidden", type=int, default=512, help="model hidden size (default 512)")
    parser.add_argument("--layers", type=int, default=8, help="model layers (default 8)")
    parser.add_argument(
        "--step-tokens", type=int, default=256, help="vLLM's tokens per step (default 256)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and prompts")
    parser.add_argument(
        "--engines",
        choices=("both", "gate-on"),
        default="both",
        help="gate-on: skip the gate-off engine and its case (b), half the time",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def write_model(path: Path, hidden: int, layers: int, seed: int) -> int:
    """A random Llama (float32, head size 64, two KV heads) saved at ``path``; its parameters."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=layers,
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def run_engine(job: Any, target: Callable[[Any, Any], None] = child_main) -> dict[str, Any]:
    """Runs ``target(job, connection)`` in a spawned process (vLLM's engine wants one of its
    own); the figures it sends, or RuntimeError with its traceback."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    proc = context.Process(target=target, args=(job, child), name="kvtier-bench-engine")
    proc.start()
    child.close()
    try:
        if not parent.poll(ENGINE_TIMEOUT_S):
            raise RuntimeError(f"the engine gave no answer in {ENGINE_TIMEOUT_S:.0f} s")
        status, value = parent.recv()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status != "ok":
        raise RuntimeError(f"the engine failed:\n{value}")
    return value


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        print(
            "kvtier bench gate: vLLM is not importable in this Python (the gate lives in the "
            "vLLM connector); run it with vLLM's CPU build installed (nothing was measured)",
            file=sys.stderr,
        )
        return NOT_AVAILABLE_EXIT
    if args.prompt_tokens < 4 * BLOCK_TOKENS:
        raise SystemExit(f"kvtier bench gate: --prompt-tokens must be >= {4 * BLOCK_TOKENS}")
    if args.hidden < 128 or args.hidden % 64:
        raise SystemExit("kvtier bench gate: --hidden must be a multiple of 64, at least 128")
    started = time.perf_counter()
    rng = random.Random(args.seed)
    prompts = {
        name: [rng.randrange(3, VOCAB) for _ in range(args.prompt_tokens)] for name in PROMPT_NAMES
    }
    for name in ("probe-fast", "probe-crawl"):
        # Short enough that its load lands within the connector's deadline even from the
        # crawling disk: the daemon then measures the crawl and is done reading.
        prompts[name] = prompts[name][: PROBE_BLOCKS * BLOCK_TOKENS + 1]
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-gate-") as tmp:
        root = Path(tmp)
        params = write_model(root / "model", args.hidden, args.layers, args.seed)
        blocks = len(PROMPT_NAMES) * -(-args.prompt_tokens // BLOCK_TOKENS)
        block_bytes = 2 * args.layers * 2 * 64 * BLOCK_TOKENS * 4
        job = EngineJob(
            model=str(root / "model"),
            daemon_root=str(root / "daemon"),
            daemon_name=f"bench-gate-{uuid.uuid4().hex[:8]}",
            host_bytes=2 * blocks * block_bytes,
            disk_bytes=4 * blocks * block_bytes,
            load_gate=True,
            crawl_ms=args.crawl_ms,
            max_model_len=args.prompt_tokens + BLOCK_TOKENS,
            step_tokens=args.step_tokens,
            prompts=prompts,
        )
        gate_on = run_engine(job)
        gate_off = run_engine(replace(job, load_gate=False)) if args.engines == "both" else None
    engines = [gate_on] if gate_off is None else [gate_on, gate_off]
    recompute = [ms for engine in engines for ms in engine["recompute"]["runs_ms"]]
    summary = {
        "engine": "vllm (CPU)",
        "model_params": params,
        "prompt_tokens": args.prompt_tokens,
        "block_tokens": BLOCK_TOKENS,
        "step_tokens": args.step_tokens,
        "crawl_ms_per_block_read": args.crawl_ms,
        "repeats": REPEATS,
        "recompute_ttft_ms": statistics.median(recompute),
        **_case_figures(gate_on, "fast_disk_gate_on"),
        **(_case_figures(gate_off, "crawling_disk_gate_off") if gate_off is not None else {}),
        **_case_figures(gate_on, "crawling_disk_gate_on"),
        "gate_on_engine": gate_on,
        **({"gate_off_engine": gate_off} if gate_off is not None else {}),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_text(summary)
    return 0


def _case_figures(engine: dict[str, Any], case: str) -> dict[str, float]:
    return {
        f"{case}_ttft_ms": engine[case]["ttft_ms"],
        f"{case}_vs_recompute": engine[case]["vs_recompute"],
    }


def print_text(s: dict[str, Any]) -> None:
    on, off = s["gate_on_engine"], s.get("gate_off_engine")
    rows = [
        ("recompute (no kvtier hit), gate on", on["recompute"]),
        *([("recompute (no kvtier hit), gate off", off["recompute"])] if off else []),
        ("(a) fast disk, gate on", on["fast_disk_gate_on"]),
        *([("(b) crawling disk, gate off", off["crawling_disk_gate_off"])] if off else []),
        ("(c) crawling disk, gate on", on["crawling_disk_gate_on"]),
    ]
    lines = [
        f"vLLM CPU engine, {s['model_params'] / 1e6:.1f}M-parameter model, "
        f"{s['prompt_tokens']}-token prompts, {s['step_tokens']}-token steps; crawling disk: "
        f"every {s['block_tokens']}-token block read delayed {s['crawl_ms_per_block_read']:g} ms",
        f"the gate's estimates in tokens/s: fast disk {on['gate_fast']}; "
        f"crawling disk {on['gate_crawl']}",
        "",
        f"{'prompt':<38}{'TTFT ms':>9}{'/ recompute':>13}{'cached tokens':>16}"
        f"{'declined':>10}{'disk reads':>12}",
    ]
    for name, r in rows:
        cached = "/".join(map(str, r["cached_tokens"]))
        lines.append(
            f"{name:<38}{r['ttft_ms']:>9.0f}{r['vs_recompute']:>13.2f}{cached:>16}"
            f"{r['declined_disk_tokens']:>10}{r['disk_blocks_read']:>12}"
        )
    lines.append(
        f"recompute TTFT (median of every engine) {s['recompute_ttft_ms']:.0f} ms; "
        f"each case's median of {s['repeats']} prompts, and of its ratios to the recompute "
        f"served next to each; wall {s['wall_s']:.1f} s"
    )
    print("\n".join(lines))
