"""Planning block copies: which byte runs move, merged as far as they go, and in what chunks.

Pure arithmetic, the same on every device: the copy engine turns a batch of (block, slot)
pairs into runs and only then touches memory. A run is one ``cudaMemcpyAsync`` on a GPU and
one ``memcpy`` on a CPU, so merging consecutive blocks that land in consecutive slots is what
turns a 100-block hit into a handful of DMAs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Run:
    """``nbytes`` at ``device`` (offset in device memory) and ``host`` (offset in the slab)."""

    device: int
    host: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Runs:
    """A transfer's runs as columns: run ``i`` is ``nbytes[i]`` at ``device[i]`` and
    ``host[i]``. The engine's thread plans a transfer every step, and an object per run cost
    it more than the planning itself (32 scattered blocks: 26 µs with a ``Run`` each, 8 as
    columns, which also go to the runtime's batch call without being taken apart)."""

    device: list[int]
    host: list[int]
    nbytes: list[int]

    def __len__(self) -> int:
        return len(self.nbytes)

    def __iter__(self) -> Iterator[Run]:
        for device, host, nbytes in zip(self.device, self.host, self.nbytes, strict=True):
            yield Run(device, host, nbytes)


def plan_runs(
    device_offsets: Sequence[int],
    host_offsets: Sequence[int],
    size: int,
    host_boundary: int = 0,
) -> Runs:
    """One run per pair of ``size`` bytes, each merged into the last when both sides continue
    it. No run crosses a multiple of ``host_boundary`` on the host side (0: no boundary), as
    one copy must stay inside one host registration."""
    if len(device_offsets) != len(host_offsets):
        raise ValueError(f"{len(device_offsets)} device offsets for {len(host_offsets)} host ones")
    runs = Runs([], [], [])
    devices, hosts, lengths = runs.device, runs.host, runs.nbytes
    dev0 = host0 = length = 0
    for dev, host in zip(device_offsets, host_offsets, strict=True):
        if (
            length
            and dev == dev0 + length
            and host == host0 + length
            and (not host_boundary or host // host_boundary == host0 // host_boundary)
        ):
            length += size
            continue
        if length:
            devices.append(dev0)
            hosts.append(host0)
            lengths.append(length)
        dev0, host0, length = dev, host, size
    if length:
        devices.append(dev0)
        hosts.append(host0)
        lengths.append(length)
    return runs


def chunk_ranges(count: int, per_chunk: int) -> list[range]:
    """``range(count)`` cut into consecutive ranges of at most ``per_chunk`` items."""
    if per_chunk < 1:
        raise ValueError(f"per_chunk must be positive, got {per_chunk}")
    return [range(start, min(start + per_chunk, count)) for start in range(0, count, per_chunk)]


def check_pairs(block_ids: Sequence[int], slots: Sequence[int], num_blocks: int, num_slots: int):
    """Raises ``ValueError`` unless the pairs are non-empty, matched and in range."""
    if len(block_ids) != len(slots) or not block_ids:
        raise ValueError(
            f"need matching non-empty block ids and slots, got {len(block_ids)} and {len(slots)}"
        )
    if min(block_ids) < 0 or max(block_ids) >= num_blocks:
        raise ValueError(f"block ids must lie in [0, {num_blocks}), got {list(block_ids)[:8]}")
    if min(slots) < 0 or max(slots) >= num_slots:
        raise ValueError(f"slots must lie in [0, {num_slots}), got {list(slots)[:8]}")
