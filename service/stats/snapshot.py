"""``Daemon.stats()``: a snapshot of every counter of a daemon, as plain values, which the
gRPC ``Stats`` call, ``/stats`` and ``/metrics`` are all built from."""

from __future__ import annotations

import time


def snapshot(daemon) -> dict:
    """Every counter of ``daemon`` (a ``Daemon``), as plain values."""
    held = daemon.fence.held()
    tiers, layouts = [], []
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
    sessions, reserved, ahead, acquired, _ = daemon.sessions.held()
    return {
        "tiers": tiers,
        "layouts": layouts,
        "sessions": sessions,
        "reserved_slots": reserved,
        "reserved_ahead_slots": ahead,
        "acquired_slots": acquired,
        "quarantined_slots": sum(layout["quarantined_slots"] for layout in layouts),
        "uptime_s": time.monotonic() - daemon.started,
        "events_dropped": daemon.events.dropped,
        "watchers": len(daemon.events),
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
