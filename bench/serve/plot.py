"""``kvtier bench serve --plot``: the distribution of time to first token, one line per arm.

Drawn with matplotlib's Agg backend, no display needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.bench.serve.arms import TITLES


def plot_ttft_cdf(path: str, title: str, arms: Sequence[tuple[str, Sequence[float]]]) -> None:
    """Writes the PNG: for each ``(arm name, TTFTs in ms)``, the fraction of requests whose
    first token came within x ms."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, ttfts in arms:
        xs = np.sort(np.asarray(ttfts, dtype=float))
        ys = np.arange(1, len(xs) + 1) / max(len(xs), 1)
        ax.step(xs, ys, where="post", label=TITLES.get(name, name))
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.set_title(f"Serving: {title.rsplit('/', 1)[-1]}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
