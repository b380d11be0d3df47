"""Pins for agent sessions under vLLM's real Scheduler: a request sent with
``kv_transfer_params={"kvtier": {"pin_s": N}}`` has its stored prefix pinned in the daemon's
host tier once its stores have landed, so the agent's next call finds it there however many
other blocks were stored meanwhile; a request without it, or with a bad one, pins nothing.

Run in the vLLM venv: ``VLLM_TARGET_DEVICE=cpu pytest -m vllm tests/test_vllm_pins.py``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connector.vllm.pins import pin_seconds

import vllmdaemon
import vllmharness as harness
from daemonutil import wait_until
from tinymodel import BLOCK
from vllmdaemon import daemon_stats, flood
from vllmharness import assert_scheduler_empty, prompt

pytestmark = pytest.mark.vllm

_none_hash = harness._none_hash
daemon = vllmdaemon.daemon
model_dir = harness.model_dir
make_engine = harness.make_engine


def pinned_blocks(daemon) -> int:
    return daemon_stats(daemon)["layouts"][0]["pinned_blocks"]


@pytest.mark.parametrize("store_policy", ["on_compute", "on_finish"])
def test_a_request_with_pin_s_keeps_its_prefix_in_the_host_tier(
    make_engine, daemon, store_policy
) -> None:
    agent = make_engine(store_policy=store_policy)
    context = prompt(40, 4 * BLOCK)
    request = agent.add([*context, 1], "turn-1")
    request.kv_transfer_params = {"kvtier": {"pin_s": 600}}
    agent.run()
    wait_until(lambda: pinned_blocks(daemon) == 4, "the request's 4 blocks pinned")
    assert_scheduler_empty(agent.scheduler)
    flood(agent, daemon, 4 * 64)  # four times the host tier
    assert pinned_blocks(daemon) == 4
    after = make_engine()
    after.add([*context, 1, 2, 3], "turn-2")
    after.run()
    assert after.stats["loaded_blocks"] == 4
    assert after.hit_sources.get(CacheHitSource.DISK, 0) == 0


@pytest.mark.parametrize(
    ("params", "seconds"),
    [
        (None, None),
        ({}, None),
        ({"kvtier": None}, None),
        ({"kvtier": {"pin_s": 60}}, 60.0),
        ({"kvtier": {"pin_s": 0.5}}, 0.5),
        ({"kvtier": {"pin_s": 3600}}, 3600.0),
    ]
    + [({"kvtier": {"pin_s": bad}}, None) for bad in (0, -5, 3601, "60", True, float("nan"))],
)
def test_pin_s_is_read_and_checked(params, seconds) -> None:
    assert pin_seconds(SimpleNamespace(kv_transfer_params=params, request_id="r")) == seconds


@pytest.mark.parametrize("pin_s", [None, 3601])
def test_a_request_without_a_good_pin_s_pins_nothing(make_engine, daemon, pin_s) -> None:
    engine = make_engine()
    request = engine.add([*prompt(41, 4 * BLOCK), 1], "plain")
    if pin_s is not None:
        request.kv_transfer_params = {"kvtier": {"pin_s": pin_s}}
    engine.run()
    engine.worker.worker.drain()
    other = make_engine()  # a request after it, pinned, shows the daemon has answered
    pinned = other.add([*prompt(42, 2 * BLOCK), 1], "pinned")
    pinned.kv_transfer_params = {"kvtier": {"pin_s": 600}}
    other.run()
    wait_until(lambda: pinned_blocks(daemon) == 2, "the second request's pins")
    assert daemon_stats(daemon)["layouts"][0]["pins_refused"] == 0
