"""What names a model in kvtier's block hashes: a name, and a fingerprint of what its KV
depends on.

Two engines may share a block only if they compute the same KV bytes for the same tokens. The
name (``model_id``, by default vLLM's ``--model``) does not say so: one path may hold new
weights, or be served with another revision, quantisation, rope scaling or KV cache dtype, and
the disk and remote tiers outlive every such change. The fingerprint is an xxh3-128 over

* the model's config as vLLM runs it (``hf_config`` after ``hf_overrides`` in any form, the
  text config of a multimodal model within it; keys that only say where it was read from are
  left out): architecture, dimensions, rope parameters, the checkpoint's quantisation config;
* vLLM's settings that change the KV: dtype, ``--quantization``, ``--revision``,
  ``--code-revision``, ``--load-format``, the KV cache dtype and the layers it skips;
* the weights, without reading them: each safetensors file's header (tensor names, dtypes,
  shapes, offsets) and the first and last bytes of every tensor, so a fine-tune of the same
  shapes differs, and small tensors (KV scales) count whole; another weight file by its size
  and pages sampled across it; a model not on this disk by the hub commit its config came
  from;
* a speculative draft model's config and weights (EAGLE, MTP, a draft model): its layers keep
  their KV in the engine's cache beside the target's;
* KV scales computed by the engine itself (``calculate_kv_scales`` with a quantised KV cache,
  in vLLM versions that have it): they depend on the first batch the engine ran, so the
  fingerprint then holds a random nonce, and the engine shares blocks with itself alone.

``model_id`` replaces the name only (engines serving one checkpoint from different paths then
share blocks); the fingerprint applies whatever the name. LoRA adapters are named by content
per request (``adapters``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TENSOR_EDGE_BYTES = 64
"""Bytes read at each end of every safetensors tensor (all of a smaller one)."""
FILE_SAMPLES = 64
SAMPLE_BYTES = 4096
"""Pages read across a weight file whose tensors kvtier cannot list."""
MAX_HEADER_BYTES = 100 << 20
"""The safetensors format's own limit on a header."""
UNQUANTISED_KV = ("auto", "float", "float16", "bfloat16", "float32")


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """The model part of every namespace of one engine."""

    name: str
    fingerprint: bytes


def model_identity(vllm_config, model_id: str | None = None) -> ModelIdentity:
    """``model_id`` (or vLLM's ``--model``) and the fingerprint of ``vllm_config``'s model."""
    model = vllm_config.model_config
    digest = xxhash.xxh3_128()
    settings = json.dumps(kv_settings(vllm_config), sort_keys=True, default=str)
    digest.update(settings.encode())
    digest.update(weights_fingerprint(model))
    if scales_per_engine(vllm_config):
        log.warning(
            "kvtier: this engine computes its own KV scales (calculate_kv_scales), so its "
            "blocks are shared with no other engine and do not outlive it"
        )
        digest.update(os.urandom(16))
    return ModelIdentity(model_id or model.model, digest.digest())


def kv_settings(vllm_config) -> dict[str, Any]:
    """The model config and vLLM settings the fingerprint covers, as plain data."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    load = getattr(vllm_config, "load_config", None)
    # Every form of ``hf_overrides`` ends up in ``hf_config.__dict__``, which ``to_dict()``
    # deep-copies, sub-configs included (``hf_text_config`` is hf_config or nested in it): vLLM
    # 0.32-0.34 apply flat values with ``config.update`` before standardising rope, and
    # dict-valued ones (``{"rope_parameters": {...}}``, what transformers 5 models read) with
    # ``setattr`` after it. So this covers all the model reads of its config, and more: an inert
    # override (a flat ``rope_theta`` beside the checkpoint's ``rope_parameters``) only keeps
    # two engines apart, it never lets different KV meet.
    settings = {
        "hf_config": _without_origin(model.hf_config.to_dict()),
        "dtype": model.dtype,
        "quantization": model.quantization,
        "revision": model.revision,
        "code_revision": model.code_revision,
        "load_format": getattr(load, "load_format", None),
        "kv_cache_dtype": cache.cache_dtype,
        "kv_cache_dtype_skip_layers": getattr(cache, "kv_cache_dtype_skip_layers", None),
    }
    # Only an engine with a drafter gets the key: the others keep the names their blocks on
    # disk and in the remote tier were stored under.
    draft = draft_settings(vllm_config)
    if draft is not None:
        settings["draft"] = draft
    return settings


def draft_settings(vllm_config) -> dict[str, Any] | None:
    """The speculative draft model whose layers keep KV in the engine's cache, as plain data;
    None without one (no speculation, or n-gram and suffix decoding, whose draft model vLLM
    sets to the target itself)."""
    spec = getattr(vllm_config, "speculative_config", None)
    model = vllm_config.model_config
    draft = getattr(spec, "draft_model_config", None)
    if draft is None or draft is model:
        return None
    # MTP layers come from the target's own checkpoint, which the weights fingerprint covers.
    weights = b"" if draft.model == model.model else weights_fingerprint(draft)
    return {
        "method": spec.method,
        "hf_config": _without_origin(draft.hf_config.to_dict()),
        "quantization": draft.quantization,
        "revision": draft.revision,
        "weights": weights.hex(),
    }


def scales_per_engine(vllm_config) -> bool:
    """Whether the engine computes its KV scales from what it runs (not from the checkpoint)."""
    cache = vllm_config.cache_config
    calculated = getattr(cache, "calculate_kv_scales", False) or getattr(
        vllm_config.model_config, "calculate_kv_scales", False
    )
    return bool(calculated) and str(cache.cache_dtype) not in UNQUANTISED_KV


def weights_fingerprint(model_config) -> bytes:
    """The weights' fingerprint: their files on this disk, else the hub commit they came
    from, else nothing (the name and config alone then tell models apart)."""
    path = _local_weights(model_config)
    if path is not None:
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if _weights(p))
        if files:
            digest = xxhash.xxh3_128()
            for file in files:
                digest.update(file.name.encode() + b"\0")
                file_fingerprint(file, digest)
            return b"files" + digest.digest()
    commit = getattr(model_config.hf_config, "_commit_hash", None)
    if commit:
        return b"commit" + str(commit).encode()
    log.warning(
        "kvtier: no weight files of %s on this host; its blocks are named by its name, config "
        "and revision only (give each weights version its own model_id)",
        model_config.model,
    )
    return b""


def file_fingerprint(path: Path, digest) -> None:
    """Feeds ``digest`` a weight file's fingerprint (its tensors' edges, or sampled pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        digest.update(size.to_bytes(8, "little"))
        if path.suffix == ".safetensors" and _safetensors_edges(fd, size, digest):
            return
        step = max(1, size // FILE_SAMPLES)
        for offset in range(0, size, step):
            digest.update(os.pread(fd, SAMPLE_BYTES, offset))
    finally:
        os.close(fd)


def _safetensors_edges(fd: int, size: int, digest) -> bool:
    """The header and both ends of every tensor; False if the file is no safetensors file."""
    length = int.from_bytes(os.pread(fd, 8, 0), "little")
    if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
        return False
    header = os.pread(fd, length, 8)
    try:
        tensors = json.loads(header)
        spans = sorted(
            tuple(entry["data_offsets"])
            for name, entry in tensors.items()
            if name != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return False
    digest.update(header)
    base = 8 + length
    for start, end in spans:
        if end - start <= 2 * TENSOR_EDGE_BYTES:
            digest.update(os.pread(fd, end - start, base + start))
        else:
            digest.update(os.pread(fd, TENSOR_EDGE_BYTES, base + start))
            digest.update(os.pread(fd, TENSOR_EDGE_BYTES, base + end - TENSOR_EDGE_BYTES))
    return True


def _local_weights(model_config) -> Path | None:
    """The directory (or GGUF file) vLLM loaded the weights from, if it is on this host."""
    path = Path(model_config.model)
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                model_config.model, revision=model_config.revision, local_files_only=True
            )
        )
    except (ImportError, OSError, ValueError):
        return None


def _weights(path: Path) -> bool:
    return path.suffix in WEIGHT_SUFFIXES and path.is_file()


def _without_origin(value):
    """``value`` less the keys that say where a config was read from, not what it is."""
    if isinstance(value, dict):
        return {
            str(key): _without_origin(item)
            for key, item in value.items()
            if str(key)[:1] != "_" and key not in ("transformers_version", "name_or_path")
        }
    if isinstance(value, list | tuple):
        return [_without_origin(item) for item in value]
    return value
