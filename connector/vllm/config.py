"""The schema of ``kv_connector_extra_config`` for ``KVTierConnector``.

Every key is declared here with its type and default; an unknown key or a value of the wrong
type is a start-up error naming the key, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.proto import contract
from kvtier.tiers.layout import KVLayout

STORE_POLICIES = ("on_compute", "on_finish")


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """What ``KVTierConnector`` reads from ``kv_connector_extra_config``."""

    endpoint: str | None = None
    """gRPC target of the daemon: ``unix:///run/kvtier/kvtier.sock`` or ``host:port``.
    Default: the unix socket of the daemon called ``daemon_name``."""
    daemon_name: str = contract.DEFAULT_NAME
    """Name of a local daemon started without ``--socket`` (``kvtier serve --name``)."""
    token_file: str | None = None
    """File holding the shared token a TCP daemon requires (default: ``$KVTIER_TOKEN``)."""
    model_id: str | None = None
    """Names the model in every block hash. Default: vLLM's ``--model``. Set it when the same
    weights are served from different paths, so engines share blocks. It replaces the name
    only: the model fingerprint (``identity``) still tells revisions, configs, weights and
    KV scales apart."""
    store_policy: str = "on_compute"
    """``on_compute``: store each block once it is full. ``on_finish``: store a request's
    blocks when it finishes (its blocks are freed once the copy has read them)."""
    load_async: bool = True
    """Load hits between steps (the request waits in ``WAITING_FOR_REMOTE_KVS``); ``false``
    loads them in the step that computes the rest of the prompt."""
    timeout_s: float = 2.0
    """Deadline of every daemon call (an acquire gets more per byte it may read from disk);
    a late answer counts as a miss, and opens a circuit breaker until the daemon answers."""
    connect_wait_s: float = 5.0
    """How long start-up waits for the first daemon session (0: do not wait). Without a
    session every lookup is a miss; the client keeps reconnecting in the background."""
    lookup_index: bool = True
    """Answer the scheduler's lookups from the daemon's shared-memory index (a memory read)
    where the daemon is on this host; the lookup still reaches the daemon, as a call the
    scheduler does not wait for. ``false``: the scheduler waits for each ``Lookup`` call."""
    min_hit_blocks: int = 1
    """Fewest blocks worth loading; shorter hits are recomputed."""
    load_gate: bool = False
    """Load only the part of a hit whose tier delivers it faster than the engine computes
    it (measured as it runs); the rest is recomputed and counted as declined. Off until its
    estimates are proven beyond small CPU engines, whose per-read overheads make a disk look
    slower than it is."""

    def __post_init__(self) -> None:
        if self.store_policy not in STORE_POLICIES:
            raise ValueError(
                f"kv_connector_extra_config.store_policy must be one of {STORE_POLICIES}, "
                f"got {self.store_policy!r}"
            )
        if self.timeout_s <= 0:
            raise ValueError("kv_connector_extra_config.timeout_s must be positive")
        if self.connect_wait_s < 0:
            raise ValueError("kv_connector_extra_config.connect_wait_s must be >= 0")
        if self.min_hit_blocks < 1:
            raise ValueError("kv_connector_extra_config.min_hit_blocks must be >= 1")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> KVTierConfig:
        """Validates ``extra`` against the fields above and builds the config."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        for key, value in extra.items():
            _check_type(key, value, known[key])
        return cls(**extra)

    def target(self) -> str:
        """The gRPC target the client dials."""
        if self.endpoint:
            return self.endpoint
        return contract.unix_target(contract.default_socket(self.daemon_name))

    def token(self) -> str | None:
        """The shared token from ``token_file``, or None to let the client read the env."""
        if self.token_file is None:
            return None
        return Path(self.token_file).read_text().strip()

    def client(
        self,
        layout: KVLayout,
        name: str,
        *,
        map_arena: bool = True,
        engine_group: str = "",
        lookup_index: bool = False,
        reserve_ahead: bool = False,
    ) -> DaemonClient:
        """A daemon client for one connector role, with this config's endpoint and deadlines;
        the roles of one engine name the same ``engine_group``; ``lookup_index``: the client
        probes the daemon's lookup index (the scheduler's, where the config says so, and a
        worker's, which stores into slots reserved ahead: ``reserve_ahead``)."""
        return DaemonClient(
            layout.signature,
            layout.block_bytes,
            block_tokens=layout.block_size,
            layout_description=layout.describe(),  # kvtier stats describes the layout by it
            target=self.target(),
            token=self.token(),
            client_name=name,
            timeout_s=self.timeout_s,
            map_arena=map_arena,
            engine_group=engine_group,
            lookup_index=lookup_index,
            reserve_ahead=reserve_ahead,
        )


def check_load_failure_policy(kv_transfer_config) -> None:
    """Refuses vLLM's default ``kv_load_failure_policy`` of ``fail``.

    A block that kvtier offered can be gone by the time it is loaded (evicted between lookup
    and acquire, a daemon restart or deadline); with ``fail`` vLLM would turn each such
    routine miss into a failed user request instead of recomputing the block.
    """
    policy = kv_transfer_config.kv_load_failure_policy
    if policy != "recompute":
        raise ValueError(
            f"KVTierConnector needs kv_load_failure_policy 'recompute', not {policy!r}: a "
            "kvtier block can vanish between lookup and load, which must cost a recompute, "
            'not the request. Add "kv_load_failure_policy": "recompute" to --kv-transfer-config.'
        )


def _check_type(key: str, value: Any, field: dataclasses.Field) -> None:
    annotation = str(field.type)
    if annotation.startswith("bool"):
        ok = isinstance(value, bool)
    elif annotation.startswith("int"):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif annotation.startswith("float"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:  # str or str | None
        ok = isinstance(value, str) or (value is None and "None" in annotation)
    if not ok:
        raise ValueError(f"kv_connector_extra_config.{key} must be {annotation}, got {value!r}")
