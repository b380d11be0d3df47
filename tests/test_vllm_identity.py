"""What names a model in kvtier's hashes, under vLLM 0.33's own configs: the model fingerprint
(``identity``) and LoRA adapters by content (``adapters``).

Engines whose KV differs for the same tokens (another rope_theta, revision, weights, KV scale,
KV cache dtype) get disjoint names, whatever ``model_id`` says; engines of one configuration
get the same names in every process, from any path holding the same files.

Run in the vLLM venv: ``VLLM_TARGET_DEVICE=cpu pytest -m vllm tests/test_vllm_identity.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")

import torch
from safetensors.torch import save_file
from vllm import SamplingParams
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
from vllm.lora.request import LoRARequest
from vllm.v1.request import Request

from kvtier.connector.vllm.adapters import AdapterKeys
from kvtier.connector.vllm.identity import model_identity
from kvtier.connector.vllm.request import extra_keys
from kvtier.tiers.hashing import ExtraKeys, Namespace, hash_prompt

from tinymodel import TINY_LLAMA

pytestmark = pytest.mark.vllm

LAYOUT = b"\x07" * 16
ROPE = {"rope_theta": 20000.0, "rope_type": "default"}
"""Another rope theta where transformers 5 keeps it and vLLM's models read it."""


def write_model(path: Path, k_scale: float = 1.0, weight: float = 0.5) -> Path:
    """A model directory: config and one safetensors file (a weight and a KV scale)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    tensors = {
        "model.layers.0.self_attn.k_proj.weight": torch.full((64, 32), weight),
        "model.layers.0.self_attn.attn.k_scale": torch.tensor(k_scale),
    }
    save_file(tensors, str(path / "model.safetensors"))
    return path


def vllm_config(model: Path, cache_dtype: str = "auto", **model_kw) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model), skip_tokenizer_init=True, dtype="float16", seed=0, **model_kw
        ),
        cache_config=CacheConfig(block_size=16, cache_dtype=cache_dtype),
    )


def with_draft(model: Path, draft: Path) -> VllmConfig:
    """``model`` served with ``draft`` as its EAGLE drafter."""
    target = vllm_config(model).model_config
    spec = SpeculativeConfig(
        method="eagle",
        model=str(draft),
        num_speculative_tokens=1,
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
    )
    return VllmConfig(
        model_config=target,
        cache_config=CacheConfig(block_size=16),
        speculative_config=spec,
    )


def seed(config: VllmConfig, model_id: str | None = None) -> bytes:
    identity = model_identity(config, model_id)
    return Namespace(identity.name, LAYOUT, fingerprint=identity.fingerprint).seed


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model")


def test_what_shapes_the_kv_gives_disjoint_names(model: Path, tmp_path: Path):
    base = seed(vllm_config(model))
    rope = vllm_config(model, hf_overrides={"rope_parameters": dict(ROPE)})
    # What vLLM's model reads (the flat rope_theta form below leaves it alone).
    assert rope.model_config.hf_text_config.rope_parameters["rope_theta"] == 20000.0
    assert seed(vllm_config(model)) == base
    others = {
        "rope_theta": seed(vllm_config(model, hf_overrides={"rope_theta": 20000.0})),
        "rope_parameters": seed(rope),
        "revision": seed(vllm_config(model, revision="v2")),
        "kv cache dtype": seed(vllm_config(model, cache_dtype="fp8")),
        "kv scale": seed(vllm_config(write_model(tmp_path / "scale", k_scale=0.5))),
        "new weights": seed(vllm_config(write_model(tmp_path / "tuned", weight=0.25))),
    }
    assert base not in others.values()
    assert len(set(others.values())) == len(others), others


def test_a_drafters_weights_name_the_blocks(model: Path, tmp_path: Path):
    """An EAGLE drafter's layer keeps its KV in the engine's cache: engines with drafters of
    one shape but other weights share no block; the same drafter files from another path do."""
    eagle = dict(TINY_LLAMA, architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1)
    drafters = {}
    for name, weight in (("eagle-a", 0.5), ("eagle-b", 0.25)):
        drafters[name] = write_model(tmp_path / name, weight=weight)
        (drafters[name] / "config.json").write_text(json.dumps(eagle))
    first = seed(with_draft(model, drafters["eagle-a"]))
    assert seed(with_draft(model, drafters["eagle-b"])) != first
    elsewhere = shutil.copytree(drafters["eagle-a"], tmp_path / "eagle-a-copy")
    assert seed(with_draft(model, elsewhere)) == first


def test_model_id_renames_but_the_fingerprint_still_applies(model: Path, tmp_path: Path):
    """Two paths holding the same files share blocks under one model_id; another revision or
    KV scale under that model_id does not."""
    copy = shutil.copytree(model, tmp_path / "elsewhere")
    shared = seed(vllm_config(model), "llama")
    assert seed(vllm_config(copy), "llama") == shared
    assert seed(vllm_config(copy)) != seed(vllm_config(model))  # the path is the default name
    assert seed(vllm_config(model, revision="v2"), "llama") != shared
    scaled = write_model(tmp_path / "scaled", k_scale=0.5)
    assert seed(vllm_config(scaled), "llama") != shared


def test_the_same_configuration_has_the_same_names_in_every_process(model: Path):
    code = (
        "import sys;"
        "from kvtier.connector.vllm.identity import model_identity;"
        "from test_vllm_identity import vllm_config;"
        "from pathlib import Path;"
        "print(model_identity(vllm_config(Path(sys.argv[1]))).fingerprint.hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "4321"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", code, str(model)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout.strip()
    assert out.splitlines()[-1] == model_identity(vllm_config(model)).fingerprint.hex()


def test_kv_scales_the_engine_computes_are_its_own(model: Path, monkeypatch):
    """Scales computed from an engine's first batch differ from engine to engine: each such
    engine names its blocks with a nonce of its own (vLLM 0.33 has no such option; older and
    newer versions name it ``calculate_kv_scales``)."""
    config = vllm_config(model, cache_dtype="fp8")
    monkeypatch.setattr(type(config.cache_config), "calculate_kv_scales", True, raising=False)
    assert model_identity(config).fingerprint != model_identity(config).fingerprint
    plain = vllm_config(model)  # an unquantised KV cache has no scales to compute
    assert model_identity(plain).fingerprint == model_identity(plain).fingerprint


# ---------------------------------------------------------------- LoRA adapters


def write_adapter(path: Path, value: float) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    weights = {
        "base_model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((8, 4), value)
    }
    tmp = path / "adapter_model.safetensors.tmp"
    save_file(weights, str(tmp))
    os.replace(tmp, path / "adapter_model.safetensors")
    return path


def lora_hashes(keys: AdapterKeys, lora: LoRARequest, tokens: list[int]) -> list[bytes]:
    request = Request(
        request_id="r",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        lora_request=lora,
    )
    extra = extra_keys(request, keys.key(request.lora_request))
    return hash_prompt(Namespace("m", LAYOUT), tokens, 4, extra)


def test_lora_adapters_are_named_by_content(tmp_path: Path):
    keys = AdapterKeys()
    tokens = list(range(12))
    a = LoRARequest("sql", 1, str(write_adapter(tmp_path / "a", 0.5)))
    same = LoRARequest("other-name", 2, str(write_adapter(tmp_path / "b", 0.5)))
    first = lora_hashes(keys, a, tokens)
    assert lora_hashes(keys, same, tokens) == first  # same files: same blocks
    assert lora_hashes(keys, a, tokens) == first
    # Reloaded under the same name and path with new weights: new names.
    write_adapter(tmp_path / "a", 0.25)
    assert lora_hashes(keys, a, tokens) != first
    assert first != hash_prompt(Namespace("m", LAYOUT), tokens, 4)


def test_an_adapter_not_on_this_host_keeps_its_name(tmp_path: Path):
    keys = AdapterKeys()
    missing = LoRARequest("remote", 3, str(tmp_path / "not-here"))
    assert keys.key(missing) == "name:remote"
    assert keys.key(None) is None
    assert ExtraKeys(lora=keys.key(missing)) != ExtraKeys()
