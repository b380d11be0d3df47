"""kvtier's tiers in vLLM's KV event stream, read the way a cache-aware router reads it.

Each engine is the harness's (vLLM 0.33's real ``Scheduler`` and ``KVTierConnector`` over a
real daemon) with ``kv_events_config`` on, so vLLM's own ``ZmqEventPublisher`` sends the
batches. ``eventutil.Router`` reads them as a router does and keeps the block hashes each
medium holds; the hashes expected are computed from token ids with vLLM's algorithm and seed.

Run in the vLLM venv: ``VLLM_TARGET_DEVICE=cpu pytest -m vllm tests/test_vllm_events.py``.
"""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")

import test_vllm_connector as harness
from test_vllm_connector import BLOCK, BLOCK_BYTES, Engine, prompt
from test_vllm_scheduler import flood
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored

import kvtier.connector.vllm.scheduler as scheduler_module

from daemonutil import Daemon, free_port
from eventutil import Router, events_config, router_hashes

pytestmark = pytest.mark.vllm

_none_hash = harness._none_hash
model_dir = harness.model_dir
WAIT_S = 60.0


class EventEngine(Engine):
    """The harness's engine with vLLM's ZMQ event publisher on."""

    def __init__(self, daemon: Daemon, model_dir, monkeypatch, **extra):
        port, replay = free_port(), free_port()
        make_config = harness.make_vllm_config

        def with_events(*args):
            config = make_config(*args)
            config.kv_events_config = KVEventsConfig(**events_config(port, replay))
            return config

        with monkeypatch.context() as patch:
            patch.setattr(harness, "make_vllm_config", with_events)
            super().__init__(daemon, model_dir, **extra)
        self.router = Router(port, replay)

    def until(self, condition, what: str) -> None:
        """Steps (vLLM publishes at the end of each step) until the router sees
        ``condition``; fails after ``WAIT_S``."""
        deadline = time.monotonic() + WAIT_S
        while True:
            self.step()
            self.router.sync()
            if condition(self.router):
                return
            assert time.monotonic() < deadline, f"the router never saw {what}"
            time.sleep(0.05)

    def close(self) -> None:
        super().close()
        self.router.close()


@pytest.fixture
def daemon():
    d = Daemon(host_bytes=32 * BLOCK_BYTES, disk_bytes=96 * BLOCK_BYTES)
    d.start()
    yield d
    d.cleanup()


@pytest.fixture
def make_engine(daemon: Daemon, model_dir, monkeypatch):
    engines: list[Engine] = []

    def make(**kwargs) -> Engine:
        engine = EventEngine(daemon, model_dir, monkeypatch, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def ours(router: Router, medium: str, hashes: list[int]) -> set[int]:
    return router.held[medium] & set(hashes)


def kvtier_events(router: Router) -> list:
    return [e for e in router.events if e.medium in (MEDIUM_CPU, MEDIUM_STORAGE)]


def announced(router: Router) -> set[int]:
    """Every hash kvtier's tiers ever named in the stream, stored or removed."""
    return {h for e in kvtier_events(router) for h in e.block_hashes}


def test_tiers_are_announced_stored_pushed_down_and_removed(make_engine, daemon) -> None:
    engine = make_engine(num_blocks=128)
    tokens = prompt(1, 4 * BLOCK)
    engine.add([*tokens, 1], "a")
    engine.run()
    want = router_hashes(tokens, 4, BLOCK)
    engine.until(lambda r: ours(r, MEDIUM_CPU, want) == set(want), "the host tier's blocks")
    engine.until(lambda r: ours(r, MEDIUM_STORAGE, want) == set(want), "the disk tier's blocks")
    stored = [e for e in kvtier_events(engine.router) if isinstance(e, BlockStored)]
    by_hash = {e.block_hashes[0]: e for e in stored if e.medium == MEDIUM_CPU}
    for i, h in enumerate(want):
        event = by_hash[h]
        assert event.token_ids == tokens[i * BLOCK : (i + 1) * BLOCK]
        assert event.block_size == BLOCK
        assert event.parent_block_hash == (want[i - 1] if i else None)
        assert event.group_idx == 0
        assert event.lora_name is None
    # Unrelated blocks (no vLLM identity: never announced) push ours out of both tiers.
    flood(engine, daemon, 160)
    engine.until(lambda r: not ours(r, MEDIUM_CPU, want), "the host tier's removals")
    engine.until(lambda r: not ours(r, MEDIUM_STORAGE, want), "the disk tier's removals")
    removed = [e for e in kvtier_events(engine.router) if isinstance(e, BlockRemoved)]
    assert {e.medium for e in removed} == {MEDIUM_CPU, MEDIUM_STORAGE}
    assert all(h in want for e in removed for h in e.block_hashes)


def test_another_engine_announces_and_loads_what_one_stored(make_engine, daemon) -> None:
    first = make_engine(num_blocks=128)
    tokens = prompt(2, 4 * BLOCK)
    first.add([*tokens, 1], "a")
    first.run()
    want = set(router_hashes(tokens, 4, BLOCK))
    first.until(lambda r: ours(r, MEDIUM_STORAGE, want) == want, "the first engine's blocks")
    # The second engine attaches later: its replay announces what the tiers already hold.
    second = make_engine(num_blocks=128)
    second.until(lambda r: ours(r, MEDIUM_CPU, want) == want, "the first engine's host blocks")
    second.until(lambda r: ours(r, MEDIUM_STORAGE, want) == want, "its disk blocks")
    second.add([*tokens, 2], "b")
    second.run()
    assert second.stats["loaded_blocks"] == 4
    # A restarted daemon has an empty host tier and the same disk tier: the host blocks are
    # withdrawn and the disk tier announced again.
    daemon.kill()
    mark = len(second.router.events)
    daemon.start()

    def disk_announced_again(router: Router) -> bool:
        again = {
            h
            for e in router.events[mark:]
            if isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE
            for h in e.block_hashes
        }
        return want <= again and not ours(router, MEDIUM_CPU, want)

    second.until(disk_announced_again, "the disk tier announced after the restart")


def test_salted_blocks_appear_only_under_their_salt(make_engine) -> None:
    engine = make_engine(num_blocks=128)
    tokens = prompt(3, 3 * BLOCK)
    for salt in ("red", "blue"):
        engine.add([*tokens, 1], salt, cache_salt=salt)
    engine.run()
    red, blue = (set(router_hashes(tokens, 3, BLOCK, salt)) for salt in ("red", "blue"))
    engine.until(lambda r: ours(r, MEDIUM_CPU, red | blue) == red | blue, "both salts' host blocks")
    assert not red & blue
    unsalted = set(router_hashes(tokens, 3, BLOCK))
    assert not announced(engine.router) & unsalted
    assert announced(engine.router) <= red | blue


def test_only_blocks_this_engine_can_load_are_announced(make_engine) -> None:
    other = make_engine(num_blocks=128, model_id="another-model")
    theirs = prompt(4, 3 * BLOCK)
    other.add([*theirs, 1], "theirs")
    other.run()
    mine = make_engine(num_blocks=128)
    tokens = prompt(5, 3 * BLOCK)
    mine.add([*tokens, 1], "mine")
    mine.run()
    want = set(router_hashes(tokens, 3, BLOCK))
    # The replay came first (the other model's blocks were in the tiers), then our blocks.
    mine.until(lambda r: ours(r, MEDIUM_STORAGE, want) == want, "this model's blocks")
    assert announced(mine.router) == want
    other.until(lambda r: ours(r, MEDIUM_CPU, set(router_hashes(theirs, 3, BLOCK))), "its blocks")
    assert not announced(other.router) & want


def test_an_engine_with_events_off_computes_no_block_identities(
    make_engine, daemon, model_dir, monkeypatch
) -> None:
    """The identities only routers read cost the engine's thread per stored block: an engine
    that publishes no events computes none (and one that does still stores them)."""
    computed = []
    identities = scheduler_module.identities

    def counted(*args):
        metas = identities(*args)
        computed.extend(metas)
        return metas

    monkeypatch.setattr(scheduler_module, "identities", counted)
    quiet = Engine(daemon, model_dir, num_blocks=128)
    try:
        quiet.add([*prompt(5, 4 * BLOCK), 1], "quiet")
        quiet.run()
        assert quiet.stats["stored_blocks"] == 4
        assert not computed
    finally:
        quiet.close()
    loud = make_engine(num_blocks=128)
    loud.add([*prompt(6, 4 * BLOCK), 1], "loud")
    loud.run()
    assert loud.stats["stored_blocks"] == 4
    assert len(computed) == 4 and all(computed)
