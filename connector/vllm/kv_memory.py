"""vLLM's KV cache as a worker's copy engines reach it, across vLLM releasing its memory.

vLLM hands the worker one view per layer (``register_kv_caches``); each KV cache group gets a
copy engine over its layers' pages. From vLLM 0.34 the KV cache on CUDA is extensible: it is
reserved as virtual memory and committed after warm-up, the worker connector is created only
then (in ``extend_kv_cache``, against the committed views), and sleep or a weight update may
release its physical memory between ``unregister_kv_caches`` and ``restore_kv_caches``. In
between, nothing may copy into or out of it: the memory may not be there, and what comes back
holds none of the old blocks. So ``release`` closes the copy engines (every copy has landed by
then) and ``restore`` derives the placements again from the views, which keep their addresses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial

import torch

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.connector.vllm.groups import KVGroup
from kvtier.connector.vllm.layout import kv_placement
from kvtier.tiers.gpu.copy_engine import CopyEngine
from kvtier.tiers.gpu.pinned import register_host, unregister_host

log = logging.getLogger(__name__)


class KVMemory:
    """The copy engine of each group over vLLM's registered KV cache, while it is there."""

    def __init__(self, groups: dict[int, KVGroup], client_of: Callable[[KVGroup], DaemonClient]):
        self._groups = groups
        self._client_of = client_of
        self._kv_caches: Mapping[str, torch.Tensor] | None = None
        self._locked: set[int] = set()
        self.engines: dict[int, CopyEngine] = {}
        """Empty before registration and while vLLM has the memory released."""

    @property
    def registered(self) -> bool:
        return self._kv_caches is not None

    @property
    def usable(self) -> bool:
        """Whether copies may touch the KV cache now."""
        return bool(self.engines)

    def register(self, kv_caches: Mapping[str, torch.Tensor], rank: int) -> None:
        self._kv_caches = kv_caches
        self._build(rank)

    def release(self) -> None:
        """Closes every copy engine (letting each copy land): vLLM may free the memory next."""
        engines, self.engines = self.engines, {}
        for engine in engines.values():
            engine.close()

    def restore(self, rank: int) -> None:
        """Copy engines again over the views vLLM registered, whose memory is back."""
        if self._kv_caches is not None and not self.engines:
            self._build(rank)

    def _build(self, rank: int) -> None:
        assert self._kv_caches is not None
        for group in self._groups.values():
            placement = kv_placement(group.layout, self._kv_caches, list(group.layer_names))
            client = self._client_of(group)
            if placement.device.type == "cuda" and id(client) not in self._locked:
                # The arena is host memory: it stays locked across a release of the KV cache.
                self._locked.add(id(client))
                device = placement.device
                client.page_lock_with(
                    partial(register_host, device=device, row_bytes=client.block_bytes),
                    lambda slab, device=device: unregister_host(slab.data_ptr(), device),
                )
            self.engines[group.index] = CopyEngine(placement, client.slab, lock_host=False)
            copies = "one DMA per block" if placement.block_contiguous else "staged"
            arena = "page-locked" if client.page_locked else "not locked yet"
            log.info(
                "kvtier worker %d, group %d (%s): %d layers, %d blocks of %d B on %s (%s), "
                "arena %s",
                *(rank, group.index, group.kind, group.layout.num_layers),
                *(placement.num_blocks, group.layout.block_bytes, placement.device, copies, arena),
            )
