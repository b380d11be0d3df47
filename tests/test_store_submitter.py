"""A store handed off to the copy engine's own thread (``tiers.gpu.submitter``).

The engine's thread hands a CUDA store off before its copies are queued; until then the
transfer has no events. These tests run the hand-off on a CPU with stand-in events: what is
checked is when a transfer may count as done, or be ordered after, not the copies.
"""

from __future__ import annotations

import threading

import pytest

from kvtier.tiers.gpu.submitter import StoreSubmitter
from kvtier.tiers.gpu.transfer import CompletionQueue, Transfer


class Flag:
    """A stand-in for a CUDA event: done when the test says so."""

    def __init__(self) -> None:
        self.fired = False

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        assert self.fired, "waited for an event the test has not fired"


class Stream:
    """A stand-in for a CUDA stream: records what it was made to wait for."""

    def __init__(self) -> None:
        self.waited: list[Flag] = []

    def wait_event(self, event: Flag) -> None:
        self.waited.append(event)


@pytest.fixture
def submitter():
    made = StoreSubmitter(None)
    yield made
    made.close()


@pytest.fixture
def gate(submitter):
    """Holds the submitter's thread inside a store; let go before the submitter closes."""
    held = threading.Event()
    yield held
    held.set()


def test_a_handed_off_store_is_not_done_before_its_copies_are_queued(submitter, gate):
    """Defect: an event never recorded counts as complete (``cudaEventQuery`` answers
    success), so a store whose copies were not yet queued would be committed unwritten."""
    done = Flag()
    done.fired = True  # as an event not yet recorded answers
    committed: list[str] = []

    def queue_copies():
        gate.wait()
        return Flag(), done, None

    stores = CompletionQueue()
    transfer = stores.push(
        submitter.submit(Transfer(1, 1, lambda: committed.append("commit")), queue_copies)
    )
    assert stores.poll() == 0 and not transfer.done() and committed == []
    gate.set()
    transfer.await_queued()
    assert stores.poll() == 1 and committed == ["commit"]


def test_ordering_after_a_handed_off_store_waits_until_it_is_queued(submitter, gate):
    """Defect: ``order_before`` on a store whose copies were not yet queued had no event to
    wait on, so the engine's next writes to those blocks could run before the copy read them."""
    done = Flag()

    def queue_copies():
        gate.wait()
        return Flag(), done, None

    transfer = submitter.submit(Transfer(1, 1), queue_copies)
    stream = Stream()
    ordered = threading.Thread(target=transfer.order_before, args=(stream,))
    ordered.start()
    assert ordered.is_alive() and stream.waited == []  # held until the copies are queued
    gate.set()
    ordered.join()
    assert stream.waited == [done]


def test_a_store_that_could_not_be_queued_raises_on_the_engines_thread(submitter):
    """A failure on the submitter's thread is not lost there: every later poll, wait or
    order raises it, and the transfer's callback never runs."""
    committed: list[str] = []

    def refuse():
        raise RuntimeError("cudaMemcpyBatchAsync: an illegal memory access")

    stores = CompletionQueue()
    transfer = stores.push(submitter.submit(Transfer(1, 1, lambda: committed.append("x")), refuse))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        transfer.wait()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="illegal memory access"):
            stores.poll()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        transfer.order_before(Stream())
    assert committed == []


def test_stores_are_queued_in_hand_off_order_and_close_queues_the_rest():
    submitter = StoreSubmitter(None)
    seen: list[tuple[int, str]] = []
    gate = threading.Event()

    def queue_copies(i: int):
        gate.wait()
        seen.append((i, threading.current_thread().name))
        return Flag(), Flag(), None

    transfers = [submitter.submit(Transfer(1, 1), lambda i=i: queue_copies(i)) for i in range(5)]
    gate.set()
    submitter.close()
    assert [i for i, _ in seen] == list(range(5))
    assert {name for _, name in seen} == {"kvtier-store-queue"}
    for transfer in transfers:
        transfer.await_queued()
