"""Lookups over the session's slot channel (or its ``SlotOps`` stream) where the daemon says it
takes them (``OpenResponse.slot_lookups``): answered as the Lookup call answers, at a third of
its cost, and ended at the call's deadline when the daemon cannot answer (frozen), as the call
would end."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from kvtier.connector.client.deadlines import Deadlines
from kvtier.connector.client.slot_answers import OpFuture
from kvtier.tiers.host.tier import LowerHits

from daemonutil import BLOCK_BYTES, Daemon, block_hash, store


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=64 * BLOCK_BYTES).start()
    yield d
    d.cleanup()


@pytest.mark.parametrize("slot_channel", [True, False], ids=["channel", "stream"])
def test_a_lookup_goes_over_the_sessions_slot_channel_and_answers_as_its_call(daemon, slot_channel):
    client = daemon.client(lookup_index=False, slot_channel=slot_channel)
    unary = daemon.client(lookup_index=False, slot_stream=False)
    try:
        hashes = [block_hash("slot-lookup", i) for i in range(12)]
        store(client, hashes[:9])
        assert client._keeper.limits.slot_lookups
        before = client.slot_calls.streamed
        for asked in (hashes, hashes[:5], hashes[9:], hashes[3:]):
            assert client.lookup(asked) == unary.lookup(asked)
        assert client.lookup(hashes) == LowerHits(host=9)
        assert client.slot_calls.streamed - before == 5
        assert unary.slot_calls.streamed == 0
        assert client.failures == unary.failures == 0
    finally:
        client.close()
        unary.close()


def test_a_daemon_that_takes_no_lookups_on_the_channel_is_asked_by_call(daemon):
    client = daemon.client(lookup_index=False)
    try:
        hashes = [block_hash("by-call", i) for i in range(4)]
        store(client, hashes)
        # what a daemon from before the channel took lookups says in its OpenResponse
        client._keeper.limits = dataclasses.replace(client._keeper.limits, slot_lookups=False)
        before = client.slot_calls.streamed
        assert client.lookup(hashes) == LowerHits(host=4)
        assert client.slot_calls.streamed == before
    finally:
        client.close()


def test_a_lookup_a_frozen_daemon_cannot_answer_misses_at_its_deadline(daemon):
    client = daemon.client(lookup_index=False, timeout_s=1.0)
    try:
        hashes = [block_hash("frozen", i) for i in range(4)]
        store(client, hashes)
        with daemon.frozen():
            answer = client.lookup_async(hashes)
            # Without its deadline it would wait for the daemon: this wait would time out.
            assert answer.result(timeout=60) == LowerHits()
            assert client.failures >= 1
    finally:
        client.close()


def test_deadlines_fail_only_what_is_unanswered_when_it_is_due():
    deadlines = Deadlines()
    try:
        patient, first, answered, late = OpFuture(), OpFuture(), OpFuture(), OpFuture()
        deadlines.watch(patient, "Lookup", 600.0)
        deadlines.watch(first, "Lookup", 0.05)
        with pytest.raises(grpc.RpcError) as failed:
            first.result(timeout=30)
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The watcher now waits for the patient one's deadline: these must wake it.
        deadlines.watch(answered, "Lookup", 0.05)
        deadlines.watch(late, "Lookup", 0.05)
        answered.finish("reply")
        with pytest.raises(grpc.RpcError) as failed:
            late.result(timeout=30)
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert answered.result(timeout=0) == "reply"
        assert not patient.done()
    finally:
        deadlines.close()
