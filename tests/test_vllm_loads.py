"""Loads larger than the host tier stream through it, a chunk at a time.

A session may hold at most half the host slots, and a hit may be several times the whole
host tier when most of it lies on disk. The worker asks for one chunk the session has room
for, copies it, releases it, then asks for the next; the fake forward pass checks every byte.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import test_vllm_connector as harness
from test_vllm_connector import BLOCK, BLOCK_BYTES, assert_scheduler_empty, prompt

from daemonutil import Daemon

pytestmark = pytest.mark.vllm

_none_hash = harness._none_hash
model_dir = harness.model_dir
make_engine = harness.make_engine

HOST_SLOTS = 8


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=64 * BLOCK_BYTES, disk_bytes=1024 * BLOCK_BYTES).start()
    yield d
    d.cleanup()


def test_an_async_hit_three_times_the_host_tier_loads_whole(make_engine, daemon) -> None:
    first = make_engine(num_blocks=64)
    shared = prompt(21, 3 * HOST_SLOTS * BLOCK)
    first.add([*shared, 1], "a")
    first.run()
    assert first.stats["stored_blocks"] == 3 * HOST_SLOTS
    # The same disk tier behind a host tier a third of the hit's size.
    assert daemon.stop() == 0
    daemon.host_bytes = HOST_SLOTS * BLOCK_BYTES
    daemon.start()
    second = make_engine(num_blocks=64)
    second.add([*shared, 2, 3], "b")
    second.run()
    assert second.stats["loaded_blocks"] == 3 * HOST_SLOTS
    assert "load_failed_blocks" not in second.stats
    assert second.checked_tokens >= 3 * HOST_SLOTS * BLOCK  # every loaded byte was read back
    assert_scheduler_empty(second.scheduler)
    harness.assert_daemon_holds_nothing(second, daemon)
