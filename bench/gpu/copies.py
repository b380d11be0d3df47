"""PCIe ceiling and kvtier's pool copy rates on a CUDA device, for ``kvtier bench gpu``.

The ceiling is a large pinned ``cudaMemcpyAsync`` each way, then both ways at once on two
streams. The pool's rates are ``CopyEngine`` stores (GPU→host) and loads (host→GPU) of
consecutive 2 MiB blocks (a Llama-3-8B-like layout: 32 layers, 8 KV heads of 128, bf16) in
kvtier's own pool, whose buffer is in the canonical ``BLHNC`` order, into an in-process host
tier's slab. The connector's path (vLLM's tensors, scattered ids, the daemon's arena, a busy
GPU) is ``connector``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.bench.limits import best_seconds
from kvtier.tiers.gpu.copy_engine import CopyEngine
from kvtier.tiers.gpu.pinned import allocate_host, unregister_host
from kvtier.tiers.gpu.placement import KVPlacement
from kvtier.tiers.layout import KVLayout

VLLM_LIKE_LAYOUT = KVLayout(
    num_layers=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16
)
"""2 MiB per block: 32 layers, K and V, 16 tokens, 8 heads of 128, 2 bytes each."""


@dataclass(frozen=True, slots=True)
class PcieCeiling:
    h2d_gbps: float
    d2h_gbps: float
    bidir_gbps: float


@dataclass(frozen=True, slots=True)
class CopyRates:
    d2h_gbps: float
    h2d_gbps: float
    block_bytes: int
    blocks: int
    round_trip_exact: bool


def best_device_seconds(fn: Callable[[], None], iters: int) -> float:
    """Fastest of ``iters`` runs of ``fn`` through to the device's last kernel, after a warm-up."""

    def synchronized() -> None:
        fn()
        torch.cuda.synchronize()

    synchronized()
    return best_seconds(synchronized, iters)


def pcie_ceiling(num_bytes: int, iters: int) -> PcieCeiling:
    """GB/s (1e9 bytes) of ``num_bytes`` pinned copies: to the GPU, from it, both at once."""
    host_in = allocate_host(num_bytes, pin=True)
    host_out = allocate_host(num_bytes, pin=True)
    try:
        return _pcie_ceiling(host_in, host_out, iters)
    finally:
        device = torch.device("cuda", torch.cuda.current_device())
        for buf in (host_in, host_out):
            unregister_host(buf.data_ptr(), device)


def _pcie_ceiling(host_in: torch.Tensor, host_out: torch.Tensor, iters: int) -> PcieCeiling:
    num_bytes = host_in.numel()
    dev_in = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dev_out = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d() -> None:
        with torch.cuda.stream(up):
            dev_in.copy_(host_in, non_blocking=True)

    def d2h() -> None:
        with torch.cuda.stream(down):
            host_out.copy_(dev_out, non_blocking=True)

    def both() -> None:
        h2d()
        d2h()

    gb = num_bytes / 1e9
    return PcieCeiling(
        h2d_gbps=gb / best_device_seconds(h2d, iters),
        d2h_gbps=gb / best_device_seconds(d2h, iters),
        bidir_gbps=2 * gb / best_device_seconds(both, iters),
    )


def copy_engine_rates(
    num_blocks: int, iters: int, layout: KVLayout = VLLM_LIKE_LAYOUT
) -> CopyRates:
    """GB/s of ``num_blocks``-block stores and loads through the reference pool's engine."""
    placement = KVPlacement.allocate(layout, num_blocks, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    placement.buffer.copy_(
        torch.randint(
            0, 256, placement.buffer.shape, dtype=torch.uint8, device="cuda", generator=gen
        )
    )
    original = placement.buffer.clone()
    slab = allocate_host(num_blocks * layout.block_bytes).view(num_blocks, -1)
    engine = CopyEngine(placement, slab)
    ids = list(range(num_blocks))

    def store() -> None:
        engine.store(ids, ids)
        engine.synchronize()

    def load() -> None:
        engine.load(ids, ids)
        engine.synchronize()

    gb = num_blocks * layout.block_bytes / 1e9
    d2h = gb / best_device_seconds(store, iters)
    placement.buffer.zero_()
    h2d = gb / best_device_seconds(load, iters)
    exact = torch.equal(placement.buffer, original)
    engine.close()
    return CopyRates(d2h, h2d, layout.block_bytes, num_blocks, exact)
