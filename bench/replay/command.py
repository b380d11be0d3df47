"""``kvtier bench replay``: a request trace through the real tier stack, against two baselines.

The same requests run three times: through the GPU pool with the host and disk tiers behind it
(the tiered run), through the same GPU pool alone (GPU-only), and through an unbounded cache
(the oracle). Everything is counted in prompt tokens. With no capacity flags the tiers are sized
from the trace: GPU 10% of its distinct full blocks, host 30%, disk all of them, so nothing the
trace reuses has to be dropped.

With ``--nodes N`` the requests are spread over N nodes, each with tiers of that size, sharing a
remote tier (``fleet``); the tiered run is then that fleet, the GPU-only run the same
nodes' GPU pools, and the fleet also runs without its remote tier (``no_remote_saved_tokens``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import asdict

from kvtier.bench.replay.fleet import ROUTERS, fleet_lines, fleet_summary, replay_fleet
from kvtier.bench.replay.plot import plot_sweep, sweep
from kvtier.bench.replay.sim import (
    REPLAY_LAYOUT,
    Capacity,
    RunResult,
    Workload,
    oracle_saved_tokens,
    replay,
)
from kvtier.bench.replay.trace import TraceHasher, load_trace
from kvtier.bench.replay.workloads import WORKLOADS
from kvtier.tiers.hashing import Namespace
from kvtier.tiers.host.admission import DEFAULT_POLICY, POLICIES

logger = logging.getLogger(__name__)

GPU_SHARE = 0.10
HOST_SHARE = 0.30
_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"4096"``, ``"64M"``, ``"2GiB"`` or ``"1g"`` as a byte count."""
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = s[-1:] if s[-1:] in _SUFFIXES else ""
    try:
        value = float(s[: len(s) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"negative byte count: {text!r}")
    return int(value * _SUFFIXES[unit])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="JSON-lines trace (Mooncake format, 512-token blocks)")
    source.add_argument("--workload", choices=sorted(WORKLOADS), help="seeded synthetic trace")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of --workload and of --router random (default 0)"
    )
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--gpu-blocks", type=int, help="GPU pool size (default: 10%% of blocks)")
    parser.add_argument("--host-bytes", type=parse_bytes, help="host tier (default: 30%%)")
    parser.add_argument("--disk-bytes", type=parse_bytes, help="disk tier (default: all blocks)")
    parser.add_argument(
        "--admission",
        choices=POLICIES,
        default=DEFAULT_POLICY,
        help="the host tier's admission policy: which blocks enter it and which it writes to "
        f"disk (default {DEFAULT_POLICY})",
    )
    parser.add_argument(
        "--as-daemon",
        action="store_true",
        help="feed the node as the vLLM connector feeds the daemon: each computed block goes "
        "to the host tier at once and is written behind to disk (default: as an engine's own "
        "stack, a block goes down when evicted; --nodes always feeds nodes as daemons)",
    )
    parser.add_argument(
        "--ms-per-output-token",
        type=float,
        default=20.0,
        help="decode time a running request holds its blocks per output token",
    )
    parser.add_argument(
        "--nodes",
        type=_positive,
        help="spread the requests over N nodes, each with these tiers, sharing a remote tier "
        "(a private redis-server)",
    )
    parser.add_argument(
        "--router",
        choices=ROUTERS,
        default=ROUTERS[0],
        help="with --nodes: how requests are spread (default round-robin)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also sweep the lower-tier capacity and plot saved tokens",
    )


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive count: {text!r}")
    return value


def load_workload(args: argparse.Namespace) -> Workload:
    if args.trace:
        name, requests = args.trace, load_trace(args.trace)
    else:
        name, requests = f"{args.workload} (seed {args.seed})", WORKLOADS[args.workload](args.seed)
    if args.limit is not None:
        requests = requests[: args.limit]
    if not requests:
        raise ValueError(f"{name}: no requests")
    started = time.perf_counter()
    hasher = TraceHasher(Namespace("kvtier-replay", REPLAY_LAYOUT.signature))
    hashes = [hasher.hashes(r) for r in requests]
    return Workload(name, requests, hashes, hasher.distinct_blocks, time.perf_counter() - started)


def default_capacity(args: argparse.Namespace, work: Workload) -> tuple[Capacity, bool]:
    """The capacity flags, each missing one sized from the trace; True if any was."""
    block_bytes = REPLAY_LAYOUT.block_bytes
    distinct = max(work.distinct_blocks, 1)
    gpu = args.gpu_blocks
    if gpu is None:
        gpu = math.ceil(GPU_SHARE * distinct)
    host = args.host_bytes
    if host is None:
        host = math.ceil(HOST_SHARE * distinct) * block_bytes
    disk = args.disk_bytes
    if disk is None:
        disk = distinct * block_bytes
    sized = None in (args.gpu_blocks, args.host_bytes, args.disk_bytes)
    return Capacity(gpu, host, disk), sized


def ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def summarize(
    work: Workload,
    capacity: Capacity,
    sized: bool,
    tiered: RunResult,
    gpu_only: RunResult,
    oracle: int,
    admission: str,
    as_daemon: bool,
) -> dict[str, object]:
    block_bytes = REPLAY_LAYOUT.block_bytes
    return {
        "source": work.name,
        "admission": admission,
        "as_daemon": as_daemon,
        "requests": len(work.requests),
        "prompt_tokens": tiered.prompt_tokens,
        "distinct_blocks": work.distinct_blocks,
        "block_tokens": REPLAY_LAYOUT.block_size,
        "block_bytes": block_bytes,
        "sized_from_trace": sized,
        "gpu_blocks": capacity.gpu_blocks,
        "host_blocks": capacity.host_bytes // block_bytes,
        "disk_blocks": capacity.disk_bytes // block_bytes,
        "host_bytes": capacity.host_bytes,
        "disk_bytes": capacity.disk_bytes,
        "gpu_hit_tokens": tiered.gpu_hit_tokens,
        "host_hit_tokens": tiered.host_hit_tokens,
        "disk_hit_tokens": tiered.disk_hit_tokens,
        "saved_tokens": tiered.saved_tokens,
        "saved_fraction": ratio(tiered.saved_tokens, tiered.prompt_tokens),
        "gpu_only_saved_tokens": gpu_only.saved_tokens,
        "oracle_saved_tokens": oracle,
        "saved_vs_oracle": ratio(tiered.saved_tokens, oracle),
        "saved_vs_gpu_only": ratio(tiered.saved_tokens, gpu_only.saved_tokens),
        "blocks_spilled_to_host": tiered.blocks_spilled_to_host,
        "blocks_spilled_to_disk": tiered.blocks_spilled_to_disk,
        "blocks_not_admitted": tiered.blocks_not_admitted,
        "blocks_kept_off_disk": tiered.blocks_kept_off_disk,
        "disk_bytes_written": tiered.disk_bytes_written,
        "bytes_written_per_saved_token": tiered.bytes_written_per_saved_token,
        "corrupt_blocks": tiered.corrupt_blocks,
        "skipped_requests": tiered.skipped_requests,
        "max_running": tiered.max_running,
        "hash_wall_s": round(work.hash_wall_s, 3),
        "tiered_wall_s": round(tiered.wall_s, 3),
        "gpu_only_wall_s": round(gpu_only.wall_s, 3),
        "tier_overhead_ms_per_request": round(
            (tiered.wall_s - gpu_only.wall_s) * 1000 / len(work.requests), 4
        ),
    }


def print_text(summary: dict[str, object]) -> None:
    s = summary
    lines = [
        f"replay of {s['source']}: {s['requests']} requests, {s['prompt_tokens']} prompt tokens, "
        f"{s['distinct_blocks']} distinct {s['block_tokens']}-token blocks",
        f"capacity: GPU {s['gpu_blocks']} blocks, host {s['host_blocks']}, disk "
        f"{s['disk_blocks']}"
        + (
            " (flags not given: sized from the trace, GPU 10%, host 30%, disk 100% of its blocks)"
            if s["sized_from_trace"]
            else ""
        ),
        f"hits (tokens): GPU {s['gpu_hit_tokens']}, host {s['host_hit_tokens']}, "
        f"disk {s['disk_hit_tokens']}"
        + (f", remote {s['remote_hit_tokens']}" if "remote_hit_tokens" in s else ""),
        f"prefill saved: {s['saved_tokens']} tokens "
        f"({_fmt(s['saved_fraction'], percent=True)} of prompt tokens)",
        f"  GPU-only: {s['gpu_only_saved_tokens']}   oracle: {s['oracle_saved_tokens']}",
        f"  tiered / oracle = {_fmt(s['saved_vs_oracle'])}   "
        f"tiered / GPU-only = {_fmt(s['saved_vs_gpu_only'])}",
        f"spilled blocks: GPU->host {s['blocks_spilled_to_host']}, host->disk "
        f"{s['blocks_spilled_to_disk']}; corrupt loads {s['corrupt_blocks']}; "
        f"skipped requests {s['skipped_requests']}",
        f"admission {s['admission']}{' (fed as the daemon)' if s['as_daemon'] else ''}: "
        f"{s['blocks_not_admitted']} blocks turned away from host, "
        f"{s['blocks_kept_off_disk']} kept off disk; disk bytes written "
        f"{s['disk_bytes_written']} ({_fmt(s['bytes_written_per_saved_token'])} per saved "
        "token)",
        f"wall: tiered {s['tiered_wall_s']} s, GPU-only {s['gpu_only_wall_s']} s "
        f"({s['tier_overhead_ms_per_request']} ms/request for the tiers), hashing "
        f"{s['hash_wall_s']} s",
    ]
    if "nodes" in s:
        lines[1:1] = fleet_lines(s)
    print("\n".join(lines))


def _fmt(value: object, percent: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1%}" if percent else f"{value:.3f}"


def run(args: argparse.Namespace) -> int:
    if args.nodes is not None and args.plot:
        raise SystemExit("kvtier bench replay: --plot sweeps one node; leave out --nodes")
    work = load_workload(args)
    capacity, sized = default_capacity(args, work)
    if sized:
        logger.info(
            "tiers sized from the trace (%d distinct blocks): GPU %d blocks, host %d B, disk %d B",
            work.distinct_blocks,
            capacity.gpu_blocks,
            capacity.host_bytes,
            capacity.disk_bytes,
        )
    ms, policy = args.ms_per_output_token, args.admission
    fleet = None
    if args.nodes is None:
        tiered = replay(
            work.requests,
            work.hashes,
            capacity,
            ms_per_output_token=ms,
            label="tiered",
            admission=policy,
            as_daemon=args.as_daemon,
        )
        gpu_only = replay(
            work.requests,
            work.hashes,
            Capacity(capacity.gpu_blocks),
            ms_per_output_token=ms,
            label="gpu-only",
        )
    else:
        fleet = replay_fleet(
            work,
            capacity,
            args.nodes,
            args.router,
            seed=args.seed,
            ms_per_output_token=ms,
            admission=policy,
        )
        tiered, gpu_only = fleet.shared, fleet.gpu_only
    oracle = oracle_saved_tokens(work.requests, work.hashes)
    as_daemon = args.as_daemon or args.nodes is not None
    summary = summarize(work, capacity, sized, tiered, gpu_only, oracle, policy, as_daemon)
    if fleet is not None:
        summary |= fleet_summary(fleet)
    if args.plot:
        points = sweep(work, capacity, tiered, gpu_only, ms, policy, as_daemon)
        plot_sweep(
            args.plot, work.name, points, gpu_only.saved_tokens, oracle, work.distinct_blocks
        )
        summary["plot"] = args.plot
        summary["sweep"] = [asdict(p) for p in points]
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_text(summary)
    return 0
