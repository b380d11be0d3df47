"""The daemon's client plugs into ``build_stack``: spilled blocks come back bit-exact."""

from __future__ import annotations

import torch

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.tiers.hashing import Namespace, hash_prompt
from kvtier.tiers.layout import KVLayout
from kvtier.tiers.stack import build_stack

from daemonutil import Daemon
from tierutil import run_request

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, block_size=4, dtype=torch.float16)
NS = Namespace("tiny", LAYOUT.signature)


def test_spilled_blocks_come_back_through_the_daemon_and_its_restart():
    d = Daemon(host_bytes=64 * LAYOUT.block_bytes, disk_bytes=1024 * LAYOUT.block_bytes).start()
    client = DaemonClient(
        LAYOUT.signature, LAYOUT.block_bytes, block_tokens=LAYOUT.block_size, target=d.target
    )
    try:
        assert client.wait_connected(60)
        stack = build_stack(LAYOUT, 3, lower=client)
        g = torch.Generator().manual_seed(0)
        requests = [
            hash_prompt(NS, torch.randint(0, 32000, (12,), generator=g).tolist(), 4)
            for _ in range(4)
        ]
        for hashes in requests:
            assert run_request(stack, hashes) == (0, 0, 0)
        # the GPU pool holds 3 blocks: the first requests went down into the daemon
        assert run_request(stack, requests[0]) == (0, 3, 0)
        assert stack.cache.counters.host.hit_tokens == 12

        # a daemon restart: the client reconnects and re-maps the new arena by itself
        assert d.stop() == 0
        d.proc = None
        d.start()
        assert client.wait_connected(60)
        hits = run_request(stack, requests[1])
        assert hits == (0, 0, 3)  # the new daemon reads them from its disk tier, exact
        assert client.sessions_opened == 2
        stack.close()
    finally:
        client.close()
        d.cleanup()
