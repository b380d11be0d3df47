"""The capacity sweep behind ``kvtier bench replay --plot``: saved tokens vs lower-tier size.

The tiered run is repeated on the same GPU pool with a host tier of 2% to 30% of the trace's
distinct blocks and no disk, then with a disk tier behind it; GPU-only and the oracle do not
depend on the lower tiers, so they are flat lines from the main run. Drawn with matplotlib's
Agg backend, no display needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.bench.replay.sim import REPLAY_LAYOUT, Capacity, RunResult, Workload, replay

SHARES = ((0.02, 0.0), (0.05, 0.0), (0.1, 0.0), (0.3, 0.0), (0.3, 0.25))
"""(host, disk) capacities of the sweep's runs, as shares of the trace's distinct blocks."""


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One tiered run of the sweep."""

    host_blocks: int
    disk_blocks: int
    saved_tokens: int


def sweep(
    work: Workload,
    capacity: Capacity,
    main: RunResult,
    gpu_only: RunResult,
    ms_per_output_token: float,
    admission: str,
    as_daemon: bool,
) -> list[SweepPoint]:
    """Tiered runs at each of ``SHARES`` on ``capacity``'s GPU pool (the host tier under the
    ``admission`` policy, fed as the daemon if ``as_daemon``), plus the runs already made.

    No lower tier at all is the GPU-only run; the main run is the point at its own capacity.
    """
    block_bytes = REPLAY_LAYOUT.block_bytes
    points = [SweepPoint(0, 0, gpu_only.saved_tokens)]
    if capacity.host_bytes:
        points.append(
            SweepPoint(
                capacity.host_bytes // block_bytes,
                capacity.disk_bytes // block_bytes,
                main.saved_tokens,
            )
        )
    for host_share, disk_share in SHARES:
        host = max(math.ceil(host_share * work.distinct_blocks), 1)
        disk = math.ceil(disk_share * work.distinct_blocks)
        if any((p.host_blocks, p.disk_blocks) == (host, disk) for p in points):
            continue
        cap = Capacity(capacity.gpu_blocks, host * block_bytes, disk * block_bytes)
        result = replay(
            work.requests,
            work.hashes,
            cap,
            ms_per_output_token=ms_per_output_token,
            label=f"sweep host {host_share:.0%} disk {disk_share:.0%}",
            admission=admission,
            as_daemon=as_daemon,
        )
        points.append(SweepPoint(host, disk, result.saved_tokens))
    return sorted(points, key=lambda p: p.host_blocks + p.disk_blocks)


def plot_sweep(
    path: str,
    title: str,
    points: list[SweepPoint],
    gpu_only_saved: int,
    oracle_saved: int,
    distinct_blocks: int,
) -> None:
    """Writes the PNG: tiered saved tokens against (host + disk) capacity, two flat baselines."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    scale = max(distinct_blocks, 1)
    xs = [(p.host_blocks + p.disk_blocks) / scale for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(xs, [p.saved_tokens / 1e6 for p in points], "o-", label="kvtier (GPU + host + disk)")
    ax.axhline(oracle_saved / 1e6, color="black", linestyle="--", label="oracle (unbounded)")
    ax.axhline(gpu_only_saved / 1e6, color="tab:red", linestyle=":", label="GPU only")
    ax.set_xlabel("lower-tier capacity (host + disk) / the trace's distinct blocks")
    ax.set_ylabel("prefill tokens saved (millions)")
    ax.set_title(f"Trace replay: {title.rsplit('/', 1)[-1]}", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
