"""``Daemon.stats()``: a snapshot of every counter of a daemon, as plain values, which the
gRPC ``Stats`` call, ``/stats`` and ``/metrics`` are all built from."""

from __future__ import annotations

import time
from dataclasses import asdict

from kvtier.service.layout_store import DISK, HOST, REMOTE


def snapshot(daemon) -> dict:
    """Every counter of ``daemon`` (a ``Daemon``), as plain values."""
    held = daemon.fence.held()
    tiers, layouts, blocks = [], [], []
    for store in daemon.store.layouts():
        sessions, reserved, ahead, acquired, holds = daemon.sessions.held(store.signature)
        quarantined = sum(
            len(left.reserved) + len(left.acquired)
            for left in held
            if left.layout == store.signature
        )
        for counters in store.tier_counters():
            tier = {**counters.as_dict(), "layout": store.hex}
            age = store.oldest_block_age_s(counters.tier)
            if age is not None:
                tier["oldest_block_age_s"] = age
            tiers.append(tier)
        layouts.append(
            {
                "layout": store.hex,
                "slot_bytes": store.block_bytes,
                "num_slots": store.num_slots,
                "arena_path": str(store.arena.path),
                "disk": store.disk_state,
                "sessions": sessions,
                "reserved_slots": reserved,
                "reserved_ahead_slots": ahead,
                "acquired_slots": acquired,
                "quarantined_slots": quarantined,
                "writing_behind": store.host.writing_behind,
                "held_slots": holds,
                "holds_refused": daemon.sessions.holds_refused[store.signature],
                "holds_expired": daemon.sessions.holds_expired[store.signature],
                "holds_yielded": daemon.sessions.holds_yielded[store.signature],
                "holds_missed": daemon.sessions.holds_missed[store.signature],
                **_pin_stats(daemon, store.signature),
            }
        )
        blocks.append(_served_blocks(daemon, store))
    blocks += [_resting_blocks(resting) for resting in daemon.store.resting()]
    sessions, reserved, ahead, acquired, _ = daemon.sessions.held()
    return {
        "tiers": tiers,
        "layouts": layouts,
        "layout_blocks": blocks,
        "sessions": sessions,
        "reserved_slots": reserved,
        "reserved_ahead_slots": ahead,
        "acquired_slots": acquired,
        "quarantined_slots": sum(layout["quarantined_slots"] for layout in layouts),
        "uptime_s": time.monotonic() - daemon.started,
        "events_dropped": daemon.events.dropped,
        "watchers": len(daemon.events),
    }


def _served_blocks(daemon, store) -> dict:
    """A served layout's blocks per tier (counters kept as they change: nothing is read)."""
    remote = store.counters.get(REMOTE)
    return {
        "layout": store.hex,
        "open": True,
        "block_bytes": store.block_bytes,
        **asdict(daemon.store.shape(store.signature)),
        "host_blocks": store.counters[HOST].used_blocks,
        "disk_blocks": store.counters[DISK].used_blocks,
        "disk": store.disk_state,
        "remote": remote is not None,
        "remote_blocks_sent": remote.blocks_stored if remote is not None else 0,
    }


def _resting_blocks(resting) -> dict:
    """A layout found on disk at start that no session has opened since: its blocks as its
    index counted them then (nothing can have changed them)."""
    return {
        "layout": resting.signature.hex(),
        "open": False,
        "block_bytes": resting.block_bytes,
        **asdict(resting.shape),
        "host_blocks": 0,
        "disk_blocks": resting.disk_blocks,
        "disk": resting.disk,
        "remote": False,
        "remote_blocks_sent": 0,
    }


def _pin_stats(daemon, layout: bytes) -> dict:
    pins = daemon.pins.get(layout)
    if pins is None:
        return {"pinned_blocks": 0, "pins_refused": 0, "pins_missed": 0}
    return {
        "pinned_blocks": pins.pinned_blocks,
        "pins_refused": pins.refused,
        "pins_missed": pins.missed,
    }
