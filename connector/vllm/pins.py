"""Pins for agent sessions: a request sent with
``kv_transfer_params={"kvtier": {"pin_s": N}}`` has its stored prefix kept in the daemon's host
tier for N seconds (an agent's context between its tool calls), within the engine's pin budget.

The pin is asked once the request has finished and every store of its blocks has landed (vLLM
reports it in ``finished_sending``), or at once when it stored nothing new (its prefix was in
kvtier already). The daemon pins a block still being committed at its commit. The call is sent
without waiting: the engine's thread never waits on the daemon for a pin.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.connector.vllm.groups import KVGroup
from kvtier.connector.vllm.request import RequestState
from kvtier.proto.contract import MAX_PIN_S
from kvtier.tiers.hashing import BlockHash
from kvtier.tiers.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
_warn = RateLimitedLog(log, interval_s=60.0)

Pins = tuple[list[tuple[DaemonClient, list[BlockHash]]], float]
"""A request's pins: per client (one per layout) the hashes, and the seconds."""


def pin_seconds(request) -> float | None:
    """The request's ``pin_s``, or None where it asks for none or names a bad one (warned)."""
    params = getattr(request, "kv_transfer_params", None)
    ours = params.get("kvtier") if isinstance(params, dict) else None
    if not isinstance(ours, dict) or "pin_s" not in ours:
        return None
    seconds = ours["pin_s"]
    good = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
    if good and math.isfinite(seconds) and 0 < seconds <= MAX_PIN_S:
        return float(seconds)
    _warn.warning(
        "pin_s",
        "kv_transfer_params kvtier.pin_s must be a number of seconds in (0, %g], not %r; "
        "request %s is not pinned",
        MAX_PIN_S,
        seconds,
        request.request_id,
    )
    return None


class RequestPins:
    """The pins finished requests asked for, sent when their stores have landed."""

    def __init__(self, groups: list[KVGroup], clients: dict[bytes, DaemonClient]):
        self._groups = groups
        self._clients = clients
        self._waiting: dict[str, Pins] = {}

    def finished(self, state: RequestState, stores_pending: bool) -> None:
        """``state``'s request finished; with ``stores_pending`` its blocks are pinned when
        ``sent`` says its stores landed, else now."""
        seconds = pin_seconds(state.request)
        if seconds is None or state.stale:  # a stale request's blocks are found no more
            return
        by_client: dict[bytes, list[BlockHash]] = {}
        computed = state.request.num_computed_tokens
        for g, group in enumerate(self._groups):
            end = min(state.stored_blocks[g], len(state.hashes[g]))
            start = group.first_needed_block(computed)  # a window's earlier blocks are gone
            for shard in state.hashes[g].per_shard(start, end):
                by_client.setdefault(group.layout.signature, []).extend(shard)
        pins = [(self._clients[sig], hashes) for sig, hashes in by_client.items() if hashes]
        if not pins:
            return
        if stores_pending:
            self._waiting[state.request.request_id] = (pins, seconds)
        else:
            _send((pins, seconds))

    def sent(self, req_id: str) -> None:
        """Every store of ``req_id`` has landed: its pins go out."""
        pins = self._waiting.pop(req_id, None)
        if pins is not None:
            _send(pins)


def _send(pins: Pins) -> None:
    targets, seconds = pins
    for client, hashes in targets:
        client.tools.pin(hashes, seconds).add_done_callback(_refusals)


def _refusals(answer: Future[tuple[int, int]]) -> None:
    refused = answer.result()[1]
    if refused:
        _warn.warning(
            "refused",
            "kvtier refused %d pins: this engine's pin budget is full (the daemon's --pin-share)",
            refused,
        )
