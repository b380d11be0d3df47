"""``kvtier serve``'s flags: one per setting of ``DaemonConfig``, each overriding the config
file."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from kvtier.proto import contract
from kvtier.service.config import DEFAULT_STATS_PORT, DaemonConfig, load
from kvtier.tiers.host.admission import POLICIES
from kvtier.tiers.remote.config import PASSWORD_ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for every setting; each overrides the config file."""
    d = DaemonConfig()
    add = parser.add_argument
    add("--config", type=Path, help="TOML file of settings (flags override it)")
    add("--name", help=f"daemon name: socket, arena and data dir (default {d.name!r})")
    add("--socket", help=f"unix socket (default {contract.default_socket()})")
    add("--tcp", help="also listen on HOST:PORT (requires --token-file or $KVTIER_TOKEN)")
    add("--token-file", help="file holding the shared token for TCP clients")
    add("--host-bytes", help="host tier (shared-memory arena) size, e.g. 2GiB (default 2GiB)")
    add("--arena-dir", help=f"directory of the shared-memory arenas (default {d.arena_dir})")
    add("--data-dir", help="disk tier directory (default ~/.local/share/kvtier/NAME)")
    add("--disk-bytes", help="disk tier budget, e.g. 16GiB; 0 disables it (default 16GiB)")
    add(
        "--disk-sync",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fsync every disk commit (default on)",
    )
    add("--stats-host", help="statistics HTTP address (default 127.0.0.1)")
    add(
        "--stats-port",
        help=f"statistics HTTP port; 0 = any, -1 = off (default {DEFAULT_STATS_PORT}, "
        "or any free port while another daemon has that one)",
    )
    add("--lease-s", help="session lease without keep-alive, seconds (default 30)")
    add(
        "--flush-interval-s",
        help="most seconds a committed block waits to be made durable on disk "
        f"(default {d.flush_interval_s})",
    )
    add("--max-layouts", help=f"models (layouts) served at once (default {d.max_layouts})")
    add("--max-sessions", help=f"client sessions at once (default {d.max_sessions})")
    add("--max-watchers", help=f"WatchEvents subscribers (default {d.max_watchers})")
    add(
        "--lookup-hold-s",
        help="how long a lookup's host hits stay pinned for the acquire that follows "
        f"(default {d.lookup_hold_s}; 0: not at all)",
    )
    add(
        "--reserve-ahead-blocks",
        help="slots a session may keep reserved ahead of its stores, so that a store needs "
        f"no Reserve call (default {d.reserve_ahead_blocks}; 0: none)",
    )
    add(
        "--admission",
        choices=POLICIES,
        help="which blocks enter the host tier and which are written to disk: all, "
        "second-hit (on a block's second sighting), hit-to-disk (to disk only once hit in "
        f"the host tier) (default {d.admission})",
    )
    add(
        "--session-slot-share",
        help="most of a layout's slots one session may hold reserved or acquired (default 0.5)",
    )
    add(
        "--pin-share",
        help="most of a layout's slots one session may keep pinned for its requests "
        f"(kv_transfer_params pin_s) (default {d.pin_share})",
    )
    add(
        "--remote",
        metavar="URL",
        help="shared store below the disk tier: redis://HOST:PORT, rediss://..., "
        "HOST:PORT,HOST:PORT (a cluster) or mooncake://MASTER (default: none)",
    )
    add(
        "--remote-password-file",
        help=f"file holding the store's password (else ${PASSWORD_ENV}; never in the URL)",
    )
    add("--remote-ca-file", help="CA bundle to check a rediss:// store against")
    add("--remote-cert-file", help="client certificate for a rediss:// store")
    add("--remote-key-file", help="client key for a rediss:// store")
    add(
        "--remote-lookup-timeout-s",
        help=f"longest wait for the store in a lookup (default {d.remote_lookup_timeout_s})",
    )
    add(
        "--remote-transfer-timeout-s",
        help=f"longest wait for a get or a write batch (default {d.remote_transfer_timeout_s})",
    )
    add("--remote-queue-bytes", help="writes waiting for the store before drops (default 256MiB)")
    add(
        "--disk-read-delay-ms",
        help="fault injection: delay every disk read by this many ms, a crawling disk "
        "(tests and demonstrations; default 0)",
    )


def from_args(args: argparse.Namespace) -> DaemonConfig:
    """The config that ``kvtier serve`` flags describe (raises ``ConfigError``)."""
    names = {f.name for f in fields(DaemonConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in names}
    return load(args.config, **overrides)
