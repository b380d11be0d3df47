"""Admission: which offered blocks enter the host tier, and which of its blocks go to disk.

NVMe endurance is bought in bytes written, and most blocks of a real trace are never read
again. The host tier sees every lookup and every offer (a ``reserve``) of every engine it
serves, so an ``AdmissionPolicy`` can tell a block wanted twice from one seen once. The host
tier asks its policy three things, always under its own lock (a policy takes none):

* ``admit``: does an offered block enter the host tier? A block turned away gets
  ``NOT_ADMITTED`` from ``reserve``.
* ``writes_down``: does a block the host tier holds go to the disk tier (at commit when the
  tier writes behind, when it is evicted otherwise)?
* ``hit``: a block held here was hit; True when that makes it worth writing down now.

and tells it what it sees: ``looked_up`` (hashes a lookup wanted that no tier here holds) and
``dropped`` (a block left the host tier).

Policies, by name (``POLICIES``, built by ``admission_policy``):

* ``all``: every block enters and goes down.
* ``second-hit``: a block enters on its second sighting; the first one only records its hash
  in a bounded ghost list. An engine looks a block up, misses, computes it and offers it: that
  lookup and the offer that follows are ONE sighting, so a block enters when a second request
  wants it (or a block leaves the host tier and comes back).
* ``hit-to-disk``: every block enters; only a block hit while in the host tier is written to
  the disk. One that is never read back costs no NVMe write, and a restart finds only blocks
  that were read at least once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import ClassVar

from kvtier.tiers.hashing import BlockHash

GHOST_PER_SLOT = 4
"""Hashes a ghost list remembers per host slot: a block's second sighting may come long after
it left the host tier (the disk tier holds many times more)."""
MIN_GHOST = 1 << 16
"""Fewest hashes a ghost list remembers (about 9 MiB of them), however small the host tier."""
_MAX_SIGHTINGS = 255


class GhostList:
    """Hashes the host tier does not hold, each with how often it was seen; at most
    ``capacity`` of them, the least recently seen forgotten first.

    A sighting is a lookup that missed the hash or an offer of it; the offer that follows the
    engine's own lookup miss is the same sighting, so each entry also keeps whether a lookup
    miss still waits for its offer.
    """

    __slots__ = ("_entries", "capacity")

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a ghost list needs room for at least one hash, got {capacity}")
        self.capacity = capacity
        # hash -> sightings << 1 | a lookup miss waiting for its offer; one small int per
        # entry keeps a large list cheap.
        self._entries: OrderedDict[BlockHash, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def looked_up(self, block_hash: BlockHash) -> int:
        """A lookup missed the hash; returns its sightings. A miss asked again before the
        offer (the engine asking twice, or two requests at once) is no new sighting."""
        entry = self._entries.get(block_hash, 0)
        if not entry & 1:
            entry = min((entry >> 1) + 1, _MAX_SIGHTINGS) << 1 | 1
        self._put(block_hash, entry)
        return entry >> 1

    def offered(self, block_hash: BlockHash) -> int:
        """An engine offers the hash's block; returns its sightings. An offer that follows a
        lookup miss is that miss's sighting, not a new one."""
        entry = self._entries.get(block_hash, 0)
        count = entry >> 1 if entry & 1 else min((entry >> 1) + 1, _MAX_SIGHTINGS)
        self._put(block_hash, count << 1)
        return count

    def remember(self, block_hash: BlockHash) -> None:
        """A block left the host tier: it counts as seen once, so its next offer is its
        second sighting."""
        entry = self._entries.get(block_hash, 0)
        self._put(block_hash, max(entry >> 1, 1) << 1)

    def forget(self, block_hash: BlockHash) -> None:
        self._entries.pop(block_hash, None)

    def _put(self, block_hash: BlockHash, entry: int) -> None:
        entries = self._entries
        entries[block_hash] = entry
        entries.move_to_end(block_hash)
        if len(entries) > self.capacity:
            entries.popitem(last=False)


class AdmissionPolicy:
    """Admits every offered block and writes every held block down (``all``); the policies
    below refuse some of either."""

    name: ClassVar[str] = "all"

    def looked_up(self, missed: Iterable[BlockHash]) -> None:
        """A lookup wanted these hashes and neither this tier nor the disk holds them."""

    def admit(self, block_hash: BlockHash) -> bool:
        """An engine offers a block this tier lacks; True if it enters."""
        return True

    def writes_down(self, block_hash: BlockHash) -> bool:
        """Whether a block held here goes to the disk tier below."""
        return True

    def hit(self, block_hash: BlockHash) -> bool:
        """A block held here was hit; True if it should be written down now and was not."""
        return False

    def dropped(self, block_hash: BlockHash) -> None:
        """A block left this tier (evicted, or given back unwritten)."""


class AdmitAll(AdmissionPolicy):
    """Every block enters the host tier and goes to disk."""


class SecondHit(AdmissionPolicy):
    """A block enters on its second sighting; its first only records it in the ghost list."""

    name = "second-hit"

    def __init__(self, ghost_capacity: int = MIN_GHOST):
        self.ghost = GhostList(ghost_capacity)

    def looked_up(self, missed: Iterable[BlockHash]) -> None:
        for block_hash in missed:
            self.ghost.looked_up(block_hash)

    def admit(self, block_hash: BlockHash) -> bool:
        if self.ghost.offered(block_hash) < 2:
            return False
        self.ghost.forget(block_hash)
        return True

    def dropped(self, block_hash: BlockHash) -> None:
        self.ghost.remember(block_hash)


class HitToDisk(AdmissionPolicy):
    """Every block enters; only a block hit while in the host tier is written to disk."""

    name = "hit-to-disk"

    def __init__(self) -> None:
        self._hit: set[BlockHash] = set()
        """Held blocks hit since they entered; never more than the host tier's slots."""

    def writes_down(self, block_hash: BlockHash) -> bool:
        return block_hash in self._hit

    def hit(self, block_hash: BlockHash) -> bool:
        if block_hash in self._hit:
            return False
        self._hit.add(block_hash)
        return True

    def dropped(self, block_hash: BlockHash) -> None:
        self._hit.discard(block_hash)


_BUILDERS: dict[str, Callable[[int], AdmissionPolicy]] = {
    AdmitAll.name: lambda host_slots: AdmitAll(),
    SecondHit.name: lambda host_slots: SecondHit(max(MIN_GHOST, GHOST_PER_SLOT * host_slots)),
    HitToDisk.name: lambda host_slots: HitToDisk(),
}
POLICIES: tuple[str, ...] = tuple(_BUILDERS)
DEFAULT_POLICY = AdmitAll.name
"""The daemon's and the replay's policy unless told otherwise."""


def admission_policy(name: str, host_slots: int) -> AdmissionPolicy:
    """The policy called ``name`` for a host tier of ``host_slots`` slots."""
    build = _BUILDERS.get(name)
    if build is None:
        raise ValueError(f"unknown admission policy {name!r}; use one of {', '.join(POLICIES)}")
    return build(host_slots)
