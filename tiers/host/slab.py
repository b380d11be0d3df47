"""The host tier's memory: one flat uint8 buffer cut into slots, which the tier reads and
writes as a numpy array and an engine's copy engine as a torch tensor.

The daemon's tier lies in its shared-memory arena and never meets a GPU in the daemon: it is
a numpy array over the arena's mapping, and the daemon never imports torch (1.4 s of its
1.8 s start-up on the 2-core VM, and about 190 MB of its memory). An engine's own tier is
torch's page-aligned memory (``allocate_host``), which its copy engine page-locks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


class Slab:
    """``num_slots`` rows of ``block_bytes`` over ``buffer`` (flat uint8, at least that
    long), or over new torch memory (page-locked at once with ``pin=True``)."""

    def __init__(
        self, num_slots: int, block_bytes: int, buffer: np.ndarray | None, pin: bool | None
    ):
        size = num_slots * block_bytes
        self._tensor: torch.Tensor | None = None
        if buffer is None:
            from kvtier.tiers.gpu.pinned import allocate_host

            self._tensor = allocate_host(size, pin).view(num_slots, block_bytes)
            buffer = self._tensor.numpy().reshape(-1)
        elif buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.size < size:
            raise ValueError(f"host buffer must be flat uint8 with >= {size} bytes")
        self.array = buffer[:size].reshape(num_slots, block_bytes)

    @property
    def tensor(self) -> torch.Tensor:
        """The same rows as a tensor (no copy), made on first use."""
        if self._tensor is None:
            import torch

            self._tensor = torch.from_numpy(self.array)
        return self._tensor
