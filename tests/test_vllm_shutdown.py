"""Under vLLM's Scheduler and a real daemon: the connector's shutdown may come more than
once, and a second one does nothing; and it ends cleanly when it comes from an exit hook, after
Python has stopped every thread pool (as an in-process vLLM engine's shutdown comes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import vllmdaemon
import vllmharness as harness
from tinymodel import BLOCK
from vllmharness import prompt

pytestmark = pytest.mark.vllm

_none_hash = harness._none_hash
model_dir = harness.model_dir
daemon = vllmdaemon.daemon
make_engine = harness.make_engine


def test_a_second_shutdown_does_nothing(make_engine) -> None:
    engine = make_engine()
    engine.add([*prompt(60, 4 * BLOCK), 1], "stored")
    engine.run()
    for _ in range(2):
        engine.worker.shutdown()
        engine.connector.shutdown()


EXIT_SCRIPT = """
import atexit, json, sys, threading
from pathlib import Path

# Registered first, so it runs last: a kvtier thread still alive then is a client that goes
# on reopening its session after the daemon is gone (and makes its socket's directory again).
def kvtier_threads():
    print("kvtier threads at exit:", [t.name for t in threading.enumerate() if "kvtier" in t.name])


atexit.register(kvtier_threads)

sys.path.insert(0, sys.argv[2])
import vllmharness as harness
from daemonutil import Daemon
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash

init_none_hash(sha256)
model = Path(sys.argv[1])
(model / "config.json").write_text(json.dumps(harness.TINY_LLAMA))
daemon = Daemon(host_bytes=64 * harness.BLOCK_BYTES, disk_bytes=0)
daemon.start()
atexit.register(daemon.cleanup)
engine = harness.Engine(daemon, model)
engine.add([*harness.prompt(61, 4 * harness.BLOCK), 1], "stored")
engine.run()
atexit.register(engine.close)  # runs first, as an in-process vLLM's exit hook does
print("served")
"""


def test_shutdown_at_interpreter_exit_is_clean(tmp_path) -> None:
    """vLLM's in-process engine is shut down by an exit hook, after Python has stopped every
    thread pool: the worker's and the scheduler's shutdown must still end without an error,
    and leave no kvtier thread running."""
    script = tmp_path / "exit_shutdown.py"
    script.write_text(EXIT_SCRIPT)
    model = tmp_path / "model"
    model.mkdir()
    tests = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, str(script), str(model), str(tests)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert "served" in done.stdout, done.stderr[-4000:]
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    # the scheduler's side too: its client reopened its session after the daemon was removed
    assert "kvtier threads at exit: []" in done.stdout, done.stdout[-2000:]
