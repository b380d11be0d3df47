"""``OpFuture``: a slot operation's answer, waited for by any number of threads."""

from __future__ import annotations

import threading

import grpc
import pytest

from kvtier.connector.client.slot_answers import OpFuture, StreamError


def test_every_waiter_gets_the_answer_however_many_wait():
    future = OpFuture()
    got: list[object] = []
    waiting = threading.Barrier(9)

    def wait() -> None:
        waiting.wait()
        got.append(future.result(timeout=60))

    threads = [threading.Thread(target=wait) for _ in range(8)]
    for thread in threads:
        thread.start()
    waiting.wait()
    future.finish("reply")
    for thread in threads:
        thread.join(60)
    assert got == ["reply"] * 8
    assert future.result(timeout=0) == "reply"  # and whoever asks afterwards
    assert future.done()


def test_a_wait_that_runs_out_raises_and_a_later_answer_still_comes():
    future = OpFuture()
    with pytest.raises(grpc.FutureTimeoutError):
        future.result(timeout=0)
    with pytest.raises(grpc.FutureTimeoutError):
        future.exception(timeout=0.01)
    assert not future.done()
    future.finish(error=StreamError(grpc.StatusCode.UNAVAILABLE, "gone"))
    assert future.exception(timeout=0).code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError):
        future.result(timeout=-1)  # a deadline already past: the answer is there


def test_the_first_finish_wins_and_callbacks_run_once():
    future = OpFuture()
    calls: list[object] = []
    future.add_done_callback(lambda f: calls.append(f.result(timeout=0)))
    future.finish("first")
    future.finish("second")
    assert not future.cancel()
    future.add_done_callback(lambda f: calls.append(f.result(timeout=0)))
    assert calls == ["first", "first"]
    assert not future.cancelled()


def test_a_cancelled_future_wakes_its_waiter_with_cancelled():
    future = OpFuture()
    failed: list[grpc.RpcError] = []
    waiter = threading.Thread(target=lambda: failed.append(future.exception(timeout=60)))
    waiter.start()
    assert future.cancel()
    waiter.join(60)
    assert future.cancelled()
    assert failed[0].code() == grpc.StatusCode.CANCELLED
