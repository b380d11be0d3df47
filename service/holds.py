"""What a session's lookups hold for the acquires that follow them.

A lookup's host hits are held (``DaemonConfig.lookup_hold_s``), so that the acquire that
follows finds them where the answer said they are, however busy the host tier is meanwhile. A
hold keeps one pin of its block's slot, however many lookups answered that block: two requests
sharing a prefix each promise it, and ``promises`` counts them. Each acquire of the block by the
session's engine ends one promise, and the last one ends the hold and gives its pin back; the
deadline ends all of them at once.

Because a held block's slot is pinned, it cannot have been evicted or reused: a lookup whose
leading hashes its session holds already renews those holds (``renew_prefix``) without walking
the host tier or pinning anything for them. An engine looks up the same prefix again and again
(a shared system prompt, a request rescheduled, the connector's notice of each probe), and on
the 2-core VM a 1,000-hash lookup's walk and pins took most of the daemon's 0.25 ms for it back
to back and 0.8 ms after an idle pause; renewing 1,000 holds takes a few tens of µs.

The functions here act on one session's holds; ``SessionTable`` calls them under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class Hold:
    """One host hit held for the acquires to come: one pin of ``slot``, kept for ``promises``
    lookups that answered it."""

    slot: int
    promises: int
    until: float


def renew_prefix(
    holds: dict[bytes, Hold], hashes: Sequence[bytes], until: float, at_most: int | None
) -> int:
    """How many leading ``hashes`` (at most ``at_most``, if given) are held already: each of
    those holds gains a promise and the deadline ``until``."""
    limit = len(hashes) if at_most is None else min(at_most, len(hashes))
    get = holds.get
    count = 0
    while count < limit:
        held = get(hashes[count])
        if held is None:
            break
        held.promises += 1
        held.until = until
        count += 1
    return count


def keep_pinned(
    holds: dict[bytes, Hold], pinned: Sequence[tuple[bytes, int]], until: float, room: int
) -> tuple[list[int], int]:
    """Holds the host hits ``pinned`` (hash, slot), each pinned once by its lookup, for up to
    ``room`` new holds; returns the slots whose pin the caller gives back, and how many of
    those were refused for want of room. A hit held already gains a promise, and gives its
    lookup's pin back: its hold keeps one."""
    back: list[int] = []
    refused = 0
    for block_hash, slot in pinned:
        held = holds.get(block_hash)
        if held is not None and held.slot == slot:
            held.promises += 1
            held.until = until
            back.append(slot)
        elif held is None and room > 0:
            holds[block_hash] = Hold(slot, 1, until)
            room -= 1
        else:
            back.append(slot)
            refused += 1
    return back, refused


def end_promises(holds: dict[bytes, Hold], hashes: Sequence[bytes]) -> list[int]:
    """Ends one promise of each hold on ``hashes``; returns the slots of the holds that ended
    (their pins to give back)."""
    ended: list[int] = []
    for block_hash in hashes:
        held = holds.get(block_hash)
        if held is None:
            continue
        held.promises -= 1
        if held.promises == 0:
            del holds[block_hash]
            ended.append(held.slot)
    return ended


def pins_of(holds: Iterable[Hold]) -> list[int]:
    """The slot each of ``holds`` keeps pinned."""
    return [held.slot for held in holds]
