"""Deferred stores: copied at a later step's start, reserved off the engine's thread."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtier.connector.vllm.stores import StoreQueue


class SlowDaemon:
    """A reserve that answers only when the test lets it, from the helper thread."""

    def __init__(self) -> None:
        self.gates: list[threading.Event] = []
        self.threads: list[str] = []

    def reserve(self, hashes: list[bytes], parents: list[bytes]) -> list[int]:
        self.threads.append(threading.current_thread().name)
        gate = threading.Event()
        self.gates.append(gate)
        assert gate.wait(10)
        return list(range(len(hashes)))


@pytest.fixture
def helper():
    with ThreadPoolExecutor(1, thread_name_prefix="reserve") as pool:
        yield pool


def wait_for_asks(daemon: SlowDaemon, n: int) -> None:
    for _ in range(1000):
        if len(daemon.gates) >= n:
            return
        threading.Event().wait(0.01)
    raise AssertionError("the reserve was never asked")


def test_stores_wait_for_their_reservation_in_order(helper):
    """Defect: stores were reserved and copied at wait_for_save, on the engine's thread,
    competing with the sampler's copy; now they start at a later step, once reserved."""
    daemon = SlowDaemon()
    queue = StoreQueue(daemon.reserve, helper)
    queue.add([b"a", b"b"], [b"", b"a"], [4, 5], ["r1", "r1"])
    queue.add([b"c"], [b"b"], [6], ["r2"])
    assert queue.take_ready() == []  # nothing answered yet: the step goes on without them
    wait_for_asks(daemon, 1)
    daemon.gates[0].set()
    wait_for_asks(daemon, 2)
    ready = queue.take_ready()
    assert [(s.block_ids, slots) for s, slots in ready] == [([4, 5], [0, 1])]
    assert len(queue) == 1
    daemon.gates[1].set()
    assert [s.block_ids for s, _ in queue.take_all()] == [[6]]
    assert len(queue) == 0
    assert all(name.startswith("reserve") for name in daemon.threads)


def test_a_preempted_request_forces_its_stores_and_those_before(helper):
    daemon = SlowDaemon()
    queue = StoreQueue(daemon.reserve, helper)
    queue.add([b"a"], [b""], [1], ["r1"])
    queue.add([b"b"], [b""], [2], ["r2"])
    queue.add([b"c"], [b""], [3], ["r3"])

    def answer_all() -> None:
        for i in range(3):
            wait_for_asks(daemon, i + 1)
            daemon.gates[i].set()

    answering = threading.Thread(target=answer_all)
    answering.start()
    ready = queue.take_ready(must={"r2"})  # its blocks may be overwritten by this step
    answering.join()
    assert [s.owners for s, _ in ready][:2] == [["r1"], ["r2"]]
    assert [s.block_ids for s, _ in ready + queue.take_all()] == [[1], [2], [3]]
