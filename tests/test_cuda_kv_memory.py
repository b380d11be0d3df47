"""The worker's copy engines across vLLM releasing the KV cache's memory, on a real GPU
(skipped without one): ``KVMemory.release`` returns only once every copy on the side streams
has landed, so the memory can go; ``restore`` copies into the same views again.

vLLM's extensible KV cache itself (virtual memory, committed and released under the views)
needs vLLM's CUDA build; here the views are plain device tensors, overwritten between release
and restore as recommitted pages would be. The vLLM side of the calls runs on CPU in
``test_vllm_kv_memory.py``.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.connector.vllm.groups import KVGroup
from kvtier.connector.vllm.kv_memory import KVMemory
from kvtier.tiers.gpu.placement import KVPlacement
from kvtier.tiers.layout import KVLayout

from daemonutil import Daemon

pytestmark = pytest.mark.cuda

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_size=64, block_size=16, dtype=torch.bfloat16)
NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYOUT.num_layers))


def blocks_of(placement: KVPlacement, ids: list[int]) -> torch.Tensor:
    out = torch.empty((len(ids), LAYOUT.block_bytes), dtype=torch.uint8, device="cuda")
    placement.gather(torch.tensor(ids, device="cuda"), out)
    return out.cpu()


def test_release_waits_for_every_copy_and_restore_copies_into_the_views_again():
    daemon = Daemon(host_bytes=64 * LAYOUT.block_bytes, disk_bytes=256 * LAYOUT.block_bytes)
    daemon.start()
    client = DaemonClient(
        LAYOUT.signature, LAYOUT.block_bytes, block_tokens=LAYOUT.block_size, target=daemon.target
    )
    placement = KVPlacement.allocate(LAYOUT, 64, "cuda")
    placement.buffer.copy_(torch.randint(0, 256, placement.buffer.shape, device="cuda"))
    group = KVGroup(0, LAYOUT, NAMES)
    memory = KVMemory({0: group}, lambda _: client)
    try:
        assert client.wait_connected(60), daemon.log.read_text()
        memory.register(dict(zip(NAMES, placement.layer_views(), strict=True)), rank=0)
        before = blocks_of(placement, list(range(8)))
        hashes = [bytes([i]) * 16 for i in range(8)]
        slots = client.reserve(hashes)
        torch.cuda._sleep(int(2e8))  # the compute stream is busy: the store waits behind it
        store = memory.engines[0].store(list(range(8)), slots)
        memory.release()
        assert store.done() and not memory.engines  # landed before the memory may go
        assert client.commit(slots)

        placement.buffer.fill_(0)  # recommitted pages hold none of the old blocks
        memory.restore(rank=0)
        acquired = client.acquire(hashes)
        memory.engines[0].load(acquired, list(range(8, 16))).order_before()
        assert torch.equal(blocks_of(placement, list(range(8, 16))), before)
        memory.engines[0].poll()
        client.release(acquired)
        client.settle()
    finally:
        memory.release()
        client.close()
        daemon.cleanup()
