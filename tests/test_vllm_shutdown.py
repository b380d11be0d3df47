"""Under vLLM 0.33's Scheduler and a real daemon: the connector's shutdown may come more than
once (vLLM's in-process engine shuts its worker down, and its exit hooks do it again), and a
second one does nothing."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import test_vllm_connector as harness
from test_vllm_connector import BLOCK, prompt

pytestmark = pytest.mark.vllm

_none_hash = harness._none_hash
model_dir = harness.model_dir
daemon = harness.daemon
make_engine = harness.make_engine


def test_a_second_shutdown_does_nothing(make_engine) -> None:
    engine = make_engine()
    engine.add([*prompt(60, 4 * BLOCK), 1], "stored")
    engine.run()
    for _ in range(2):
        engine.worker.shutdown()
        engine.connector.shutdown()
