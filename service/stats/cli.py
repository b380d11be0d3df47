"""``kvtier stats``: a running daemon's hits per tier, as a table or JSON.

Asks the daemon's ``Stats`` call over its unix socket (or ``--target`` with a token), so it
needs no HTTP port. ``--watch`` redraws every few seconds until interrupted. Below the tiers, a
table of blocks per layout, each layout described (tokens per block, layers, KV heads, head
size, dtype: ``?`` where no client said), layouts found on disk that no session has opened
since the daemon started included: blocks of a layout no engine asks for any more.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from kvtier.proto import contract
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc

_COLUMNS = (
    ("tier", "tier", "{}"),
    ("query tok", "query_tokens", "{:,}"),
    ("hit tok", "hit_tokens", "{:,}"),
    ("hit rate", None, "{:.1%}"),
    ("blocks", "used_blocks", "{:,}"),
    ("capacity", "capacity_blocks", "{:,}"),
    ("stored", "blocks_stored", "{:,}"),
    ("loaded", "blocks_loaded", "{:,}"),
    ("evicted", "blocks_evicted", "{:,}"),
    ("promoted", "blocks_promoted", "{:,}"),
    ("bad sums", "checksum_failures", "{:,}"),
)
# per-layout table: title, LayoutBlocks field
_SHAPE = (
    ("tokens", "block_tokens"),
    ("layers", "num_layers"),
    ("kv heads", "num_kv_heads"),
    ("head size", "head_size"),
)
RESTING_NOTE = "on disk only: no session since start"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the raw counters as JSON")
    parser.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C",
    )
    parser.add_argument("--name", default=contract.DEFAULT_NAME, help="daemon name")
    parser.add_argument("--target", help="unix:/path or host:port (default: the daemon's socket)")
    parser.add_argument(
        "--token-file", type=Path, help=f"token for TCP (else ${contract.TOKEN_ENV})"
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")


def run(args: argparse.Namespace) -> int:
    target = args.target or contract.unix_target(contract.default_socket(args.name))
    token = args.token_file.read_text().strip() if args.token_file else None
    metadata = contract.bearer(token) if token else None
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.KvTierStub(channel)
        while True:
            try:
                stats = stub.Stats(pb.StatsRequest(), timeout=args.timeout, metadata=metadata)
            except grpc.RpcError as exc:
                print(
                    f"kvtier stats: no daemon at {target} ({exc.code().name}: {exc.details()})",
                    file=sys.stderr,
                )
                return 1
            text = render_json(stats) if args.json else render_table(stats)
            if args.watch is None:
                print(text)
                return 0
            print("\033[2J\033[H" + text, flush=True)
            try:
                time.sleep(args.watch)
            except KeyboardInterrupt:
                return 0


def render_json(stats: pb.StatsResponse) -> str:
    return json.dumps(
        MessageToDict(
            stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        ),
        indent=2,
    )


def render_table(stats: pb.StatsResponse) -> str:
    """Hits per tier (per layout when there are several), then sessions and layouts."""
    several = len(stats.layouts) > 1
    columns = (("layout", None, "{}"), *_COLUMNS) if several else _COLUMNS
    rows = [[title for title, _, _ in columns]]
    for tier in stats.tiers:
        row = [tier.layout[:12]] if several else []
        for _, field, fmt in _COLUMNS:
            if field is None:
                rate = tier.hit_tokens / tier.query_tokens if tier.query_tokens else 0.0
                row.append(fmt.format(rate))
            else:
                row.append(fmt.format(getattr(tier, field)))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = [
        "  ".join(
            cell.rjust(w) if i > several else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    if not stats.tiers:
        lines.append("(no layout yet: no client has opened a session)")
    host = [t for t in stats.tiers if t.tier == "host"]
    total_query = sum(t.query_tokens for t in host)
    total_hit = sum(t.hit_tokens for t in stats.tiers)
    overall = total_hit / total_query if total_query else 0.0
    lines.append("")
    lines.append(
        f"daemon hit rate {overall:.1%} of {total_query:,} tokens asked; "
        f"{stats.sessions} sessions, {stats.reserved_slots} slots reserved "
        f"({stats.reserved_ahead_slots} more ahead), "
        f"{stats.acquired_slots} acquired, {stats.quarantined_slots} quarantined; "
        f"up {stats.uptime_s:,.0f} s"
    )
    for layout in stats.layouts:
        lines.append(
            f"layout {layout.layout[:12]}: {layout.num_slots:,} slots of {layout.slot_bytes:,} B, "
            f"{layout.writing_behind:,} writing to disk, disk {layout.disk}"
        )
    if stats.layout_blocks:
        lines += ["", *render_layout_blocks(stats.layout_blocks)]
    return "\n".join(lines)


def render_layout_blocks(layouts) -> list[str]:
    """Blocks per layout and tier, each layout described: a layout on disk only (no session
    since start) is one no engine of this node has asked for since, stranded or not yet back.
    The remote column counts what this daemon sent the shared store since it started."""
    remote = any(layout.remote for layout in layouts)
    title = ["layout", *(t for t, _ in _SHAPE), "dtype", "host blocks", "disk blocks"]
    rows = [[*title, *(["remote sent"] if remote else []), ""]]
    for layout in layouts:
        shape = (getattr(layout, field) for _, field in _SHAPE)
        row = [layout.layout[:12], *(f"{n:,}" if n else "?" for n in shape), layout.dtype or "?"]
        row.append(f"{layout.host_blocks:,}" if layout.open else "-")
        row.append(f"{layout.disk_blocks:,}" if layout.disk in ("ok", "") else "-")
        if remote:
            row.append(f"{layout.remote_blocks_sent:,}" if layout.remote else "-")
        notes = [] if layout.open else [RESTING_NOTE]
        if layout.disk not in ("ok", "off", ""):
            notes.append(f"disk {layout.disk}")
        row.append("; ".join(notes))
        rows.append(row)
    left = {0, len(_SHAPE) + 1, len(rows[0]) - 1}  # layout, dtype, notes
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(w) if i in left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]
