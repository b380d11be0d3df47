"""``kvtier bench gpu``: PCIe ceiling, kvtier's copy rates against it, TTFT and zero-reuse cost.

Needs a CUDA device; without one it says so and exits with status 2. Every rate is printed
beside the ceiling measured in the same run. ``copy_*`` keys measure the vLLM connector's
copies alone (vLLM's ``BLHNC`` tensors, scattered ids, the daemon's arena mapped in-process,
a busy compute stream, no daemon and no calls; ``copy_lbhnc_*`` the same through the staging
ring); ``e2e_*`` keys the connector's whole call sequence through a real daemon from two
client processes (``e2e``); ``pool_*`` the reference pool's ``CopyEngine``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from kvtier.bench.gpu.connector import connector_rates, step_cost
from kvtier.bench.gpu.copies import VLLM_LIKE_LAYOUT, copy_engine_rates, pcie_ceiling
from kvtier.bench.gpu.e2e import CLIENTS, end_to_end
from kvtier.bench.gpu.engine import BLOCK_SIZE, measure_ttft, measure_zero_reuse
from kvtier.engine.config import ModelConfig
from kvtier.engine.model import Decoder

logger = logging.getLogger(__name__)

NO_GPU_EXIT = 2
MODELS = {
    "1b": ModelConfig.llama_1b,
    "tiny": lambda: ModelConfig.tiny(dtype=torch.bfloat16),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--pcie-mib", type=int, default=1024, help="bytes per ceiling copy")
    parser.add_argument("--copy-blocks", type=int, default=256, help="2 MiB blocks per batch")
    parser.add_argument("--iters", type=int, default=5, help="repeats; the best one counts")
    parser.add_argument(
        "--connector-blocks", type=int, default=1024, help="2 MiB blocks of vLLM-shaped KV"
    )
    parser.add_argument(
        "--connector-batch", type=int, default=256, help="scattered blocks per transfer"
    )
    parser.add_argument(
        "--e2e-blocks",
        type=int,
        nargs="+",
        default=[32, 128],
        help="blocks per request of the end-to-end runs through a real daemon",
    )
    parser.add_argument("--e2e-requests", type=int, default=4, help="requests per e2e client")
    parser.add_argument("--e2e-small-loads", type=int, default=50, help="timed 4-block loads")
    parser.add_argument("--steps", type=int, default=40, help="serving steps for step costs")
    parser.add_argument("--step-ms", type=float, default=10.0, help="compute per step")
    parser.add_argument("--step-blocks", type=int, default=32, help="blocks stored per step")
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="1b",
        help="reference engine size (1b: Llama 3.2 1B's shape, bf16)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=8192, help="TTFT prompt length")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="prefill chunk")
    parser.add_argument("--overhead-requests", type=int, default=8)
    parser.add_argument("--overhead-prompt-tokens", type=int, default=2048)
    parser.add_argument("--overhead-decode-steps", type=int, default=32)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print(
            "kvtier bench gpu: no CUDA GPU is present; this benchmark needs one "
            "(nothing was measured)",
            file=sys.stderr,
        )
        return NO_GPU_EXIT
    device = torch.cuda.get_device_name()
    logger.info("measuring on %s", device)
    ceiling = pcie_ceiling(args.pcie_mib << 20, args.iters)
    rates = copy_engine_rates(args.copy_blocks, args.iters)
    layout = VLLM_LIKE_LAYOUT
    path = {
        order: connector_rates(
            layout,
            order,
            args.connector_blocks,
            args.connector_batch,
            args.iters,
            ceiling.d2h_gbps,
        )
        for order in ("BLHNC", "LBHNC")
    }
    e2e = [
        end_to_end(layout, blocks, args.e2e_requests, args.e2e_small_loads)
        for blocks in args.e2e_blocks
    ]
    fastest = min(e2e, key=lambda run: run.load4_ms)  # its 4-block load and that load's parts
    steps = step_cost(layout, args.connector_blocks, args.step_blocks, args.steps, args.step_ms)
    blhnc, lbhnc = path["BLHNC"], path["LBHNC"]
    config = MODELS[args.model]()
    model = Decoder(config, "cuda")
    chunk_blocks = max(args.chunk_tokens // BLOCK_SIZE, 1)
    ttft = measure_ttft(config, model, args.prompt_tokens, chunk_blocks)
    cost = measure_zero_reuse(
        config,
        model,
        args.overhead_prompt_tokens,
        args.overhead_requests,
        args.overhead_decode_steps,
        chunk_blocks,
    )
    out = {
        "device": device,
        "pcie_h2d_gbps": round(ceiling.h2d_gbps, 2),
        "pcie_d2h_gbps": round(ceiling.d2h_gbps, 2),
        "pcie_bidir_gbps": round(ceiling.bidir_gbps, 2),
        "pool_block_bytes": rates.block_bytes,
        "pool_blocks": rates.blocks,
        "pool_h2d_gbps": round(rates.h2d_gbps, 2),
        "pool_d2h_gbps": round(rates.d2h_gbps, 2),
        "pool_h2d_ratio": round(rates.h2d_gbps / ceiling.h2d_gbps, 3),
        "pool_d2h_ratio": round(rates.d2h_gbps / ceiling.d2h_gbps, 3),
        "pool_round_trip_exact": rates.round_trip_exact,
        "copy_d2h_gbps": round(blhnc.d2h_gbps, 2),
        "copy_h2d_gbps": round(blhnc.h2d_gbps, 2),
        "copy_d2h_ratio": round(blhnc.d2h_gbps / ceiling.d2h_gbps, 3),
        "copy_h2d_ratio": round(blhnc.h2d_gbps / ceiling.h2d_gbps, 3),
        "copy_bidir_gbps": round(blhnc.bidir_gbps, 2),
        "copy_bidir_ratio": round(blhnc.bidir_gbps / ceiling.bidir_gbps, 3),
        "copy_round_trip_exact": blhnc.round_trip_exact and lbhnc.round_trip_exact,
        "copy_arena_pinned": blhnc.host_pinned and lbhnc.host_pinned,
        "staging_bytes": blhnc.staging_bytes,
        "copy_lbhnc_d2h_gbps": round(lbhnc.d2h_gbps, 2),
        "copy_lbhnc_h2d_gbps": round(lbhnc.h2d_gbps, 2),
        "copy_lbhnc_d2h_ratio": round(lbhnc.d2h_gbps / ceiling.d2h_gbps, 3),
        "copy_lbhnc_h2d_ratio": round(lbhnc.h2d_gbps / ceiling.h2d_gbps, 3),
        "copy_lbhnc_bidir_gbps": round(lbhnc.bidir_gbps, 2),
        "lbhnc_staging_bytes": lbhnc.staging_bytes,
        **{
            f"e2e_{key}_{run.blocks_per_request}": value
            for run in e2e
            for key, value in (
                ("store_gbps", round(run.store_gbps, 2)),
                ("load_gbps", round(run.load_gbps, 2)),
                ("store_ratio", round(run.store_gbps / ceiling.d2h_gbps, 3)),
                ("load_ratio", round(run.load_gbps / ceiling.h2d_gbps, 3)),
            )
        },
        "e2e_load4_ms": round(fastest.load4_ms, 3),
        "e2e_load4_lookup_ms": round(fastest.load4_parts_ms[0], 3),
        "e2e_load4_acquire_ms": round(fastest.load4_parts_ms[1], 3),
        "e2e_load4_copy_ms": round(fastest.load4_parts_ms[2], 3),
        "e2e_round_trip_exact": all(run.exact for run in e2e),
        "engine_thread_sync_ms": round(steps.sync_ms, 4),
        "step_ms_connector_off": round(steps.step_ms_off, 3),
        "step_ms_connector_on": round(steps.step_ms_on, 3),
        "step_overhead_zero_reuse": round(steps.overhead, 4),
        "model": config.model_id,
        "model_params": config.num_params,
        "prompt_tokens": ttft.prompt_tokens,
        "ttft_recompute_ms": round(ttft.recompute_ms, 2),
        "ttft_host_ms": round(ttft.host_ms, 2),
        "ttft_disk_ms": round(ttft.disk_ms, 2),
        "ttft_host_hit_blocks": ttft.host_hit_blocks,
        "ttft_disk_hit_blocks": ttft.disk_hit_blocks,
        "ttft_logits_equal": ttft.logits_equal,
        "step_ms_kvtier_off": round(cost.step_ms_off, 3),
        "step_ms_kvtier_on": round(cost.step_ms_on, 3),
        "zero_reuse_overhead": round(cost.overhead, 4),
    }
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"kvtier bench gpu on {device}")
    print(
        f"PCIe ceiling (pinned memcpy, {args.pcie_mib} MiB): H2D {out['pcie_h2d_gbps']} GB/s, "
        f"D2H {out['pcie_d2h_gbps']} GB/s, both at once {out['pcie_bidir_gbps']} GB/s"
    )
    print(
        f"kvtier pool CopyEngine, {rates.blocks} x {rates.block_bytes >> 20} MiB blocks: "
        f"H2D {out['pool_h2d_gbps']} GB/s ({out['pool_h2d_ratio']:.0%} of ceiling), "
        f"D2H {out['pool_d2h_gbps']} GB/s ({out['pool_d2h_ratio']:.0%}); "
        f"round trip exact: {rates.round_trip_exact}"
    )
    for name, r in (("BLHNC, one DMA per run", blhnc), ("LBHNC, staging ring", lbhnc)):
        print(
            f"connector copies ({name}), {args.connector_batch} scattered 2 MiB blocks, busy "
            f"GPU: D2H {r.d2h_gbps:.2f} GB/s ({r.d2h_gbps / ceiling.d2h_gbps:.0%}), H2D "
            f"{r.h2d_gbps:.2f} GB/s ({r.h2d_gbps / ceiling.h2d_gbps:.0%}), both at once "
            f"{r.bidir_gbps:.2f} GB/s ({r.bidir_gbps / ceiling.bidir_gbps:.0%} of "
            f"{ceiling.bidir_gbps:.2f}); GPU staging {r.staging_bytes} B; exact: "
            f"{r.round_trip_exact}; arena page-locked: {r.host_pinned}"
        )
    for run in e2e:
        print(
            f"through a real daemon, {CLIENTS} clients, {run.blocks_per_request} blocks per "
            f"request: store {run.store_gbps:.2f} GB/s ({run.store_gbps / ceiling.d2h_gbps:.0%}), "
            f"load {run.load_gbps:.2f} GB/s ({run.load_gbps / ceiling.h2d_gbps:.0%})"
        )
    print(
        f"a 4-block load, lookup to copies done: {out['e2e_load4_ms']} ms (lookup "
        f"{out['e2e_load4_lookup_ms']}, acquire {out['e2e_load4_acquire_ms']}, copy "
        f"{out['e2e_load4_copy_ms']})"
    )
    print(
        f"serving steps of {args.step_ms} ms, {args.step_blocks} blocks stored per step: "
        f"engine thread inside kvtier {out['engine_thread_sync_ms']} ms/step, step time "
        f"{out['step_ms_connector_off']} ms off, {out['step_ms_connector_on']} ms on "
        f"({out['step_overhead_zero_reuse']:+.1%})"
    )
    print(
        f"TTFT, {ttft.prompt_tokens}-token prompt, {config.num_params / 1e9:.2f}B-param model: "
        f"recompute {out['ttft_recompute_ms']} ms, host {out['ttft_host_ms']} ms "
        f"({ttft.host_hit_blocks} blocks), disk {out['ttft_disk_ms']} ms "
        f"({ttft.disk_hit_blocks} blocks, warm page cache); logits equal: {ttft.logits_equal}"
    )
    print(
        f"zero reuse: step {out['step_ms_kvtier_off']} ms off, {out['step_ms_kvtier_on']} ms "
        f"on, overhead {out['zero_reuse_overhead']:+.1%}"
    )
    return 0
