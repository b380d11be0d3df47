"""Per-tier counters: plain objects that the statistics endpoint exports.

Every count is updated by the tier that owns it while it holds its own lock, so a snapshot
taken under that lock is consistent. Query and hit counts are in tokens, as the engine sees them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

READ_RATE_WEIGHT = 0.2
"""Weight of the newest read in ``read_bytes_per_s``: a few reads follow a change of device
speed, and one stalled read does not swing the rate."""


@dataclass(slots=True)
class TierCounters:
    """Counts for one tier (``gpu``, ``host``, ``disk`` or ``remote``)."""

    tier: str
    query_tokens: int = 0
    hit_tokens: int = 0
    blocks_stored: int = 0
    blocks_loaded: int = 0
    blocks_evicted: int = 0
    blocks_spilled: int = 0
    blocks_promoted: int = 0
    blocks_deduplicated: int = 0
    blocks_dropped: int = 0
    blocks_not_admitted: int = 0
    """Offers the admission policy turned away (host)."""
    blocks_kept_off_disk: int = 0
    """Blocks that left the host tier unwritten because the admission policy kept them off the
    disk (host)."""
    bytes_in: int = 0
    bytes_out: int = 0
    checksum_failures: int = 0
    fault_misses: int = 0
    """Blocks answered as misses because the tier failed, timed out or was cut off (remote)."""
    breaker_trips: int = 0
    """Times a circuit breaker cut the tier (or one node of it) off after failures (remote)."""
    used_blocks: int = 0
    capacity_blocks: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0
    read_bytes_per_s: float = 0.0
    """Bytes a second the tier's reads have delivered lately (disk, remote): an EWMA over
    reads, each its bytes over its wall time; 0.0 before the first read."""

    def observe_read(self, nbytes: int, seconds: float) -> None:
        """Folds one read of ``nbytes`` that took ``seconds`` into ``read_bytes_per_s``."""
        rate = nbytes / max(seconds, 1e-9)
        last = self.read_bytes_per_s
        self.read_bytes_per_s = rate if not last else last + READ_RATE_WEIGHT * (rate - last)

    def as_dict(self) -> dict[str, int | str]:
        """Returns every field as a plain dict (a snapshot)."""
        return asdict(self)

    @property
    def hit_rate(self) -> float:
        """Hit tokens over query tokens, 0.0 before the first query."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
