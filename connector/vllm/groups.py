"""vLLM's KV cache groups as kvtier sees them: a layout, a namespace and a window each.

A hybrid model (gpt-oss, Gemma 2/3, Mistral-style sliding windows, Llama 4's chunked local
attention) has several KV cache groups, each with its own block table. kvtier keeps every
group's blocks apart: a group's block is its own layers' pages (``KVLayout``), named by the
request's chained hash under a namespace of its own (the group index enters the seed), so two
groups with one layout never share a name. Each group is stored and loaded on its own.

A sliding-window (or chunked-local) group needs, for a hit of ``h`` tokens, only the blocks
the next token attends to: vLLM frees the rest (``get_num_skipped_tokens``), and kvtier
neither requires nor loads them. ``skipped_tokens`` is vLLM's own rule for each kind.

Tensor parallelism: a group's KV is split in ``shards`` distinct parts; consecutive ranks that
hold identical KV (an MLA latent, ``max_tp_shards=1``; replicated KV heads) share one shard,
one namespace, and the first of them alone stores it; every one of them loads it.

Pipeline parallelism: each stage holds the KV of its own decoder layers (vLLM's
``get_pp_indices``), so a stage's blocks are a shard of their own, named by the stage's layer
range (``Namespace.layers``) and with that stage's layout (its layer count): the shards of a
group are every stage's tensor-parallel shards, stage by stage, and a hit is a hit only when
every stage holds its shard. vLLM hands the scheduler the first stage's layers alone, so a
later stage's layers are known only where they follow from its layer range: a model of one KV
cache group with one KV layer per decoder layer. Every worker checks that of its own layers at
start-up; other models are refused under pipeline parallelism.

Refused at start-up, each with the reason: Mamba and other state groups, encoder and
cross-attention, layer kinds whose window is not one of the above, groups vLLM does not
prefix-cache, layers of one group with different page shapes, quantisation whose scales live
outside the page, context parallelism, and pipeline parallelism where a stage's layers do not
follow from its layer range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvtier.connector.vllm.layout import layout_of_spec
from kvtier.tiers.hashing import Namespace
from kvtier.tiers.layout import KVLayout

FULL_KINDS = ("FullAttentionSpec", "MLAAttentionSpec")
WINDOW_KINDS = ("SlidingWindowSpec", "SlidingWindowMLASpec")
CHUNKED_KINDS = ("ChunkedLocalAttentionSpec",)

_WHY_NOT = {
    "MambaSpec": (
        "Mamba / linear-attention state is not supported: its block is a recurrent state at a "
        "block boundary, not per-token KV (see the README)"
    ),
    "EncoderOnlyAttentionSpec": "encoder-only attention keeps no KV across requests",
    "CrossAttentionSpec": "cross-attention KV belongs to the encoder input, not the prompt",
    "RSWASpec": "R-SWA evicts a gap in the middle of a request, which kvtier does not model",
    "SinkFullAttentionSpec": "attention sinks keep KV outside the token blocks",
    "HiddenStateCacheSpec": "hidden-state caches are not KV",
}


@dataclass(frozen=True, slots=True)
class Pipeline:
    """The decoder layers of every pipeline stage, and which stage this process serves."""

    stages: tuple[tuple[int, int], ...] = ()
    """``(first layer, count)`` of each stage, in stage order; empty without pipeline
    parallelism (one stage holds every layer, and its namespaces name no layer range)."""
    stage: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.stage < self.size:
            raise ValueError(f"pipeline stage {self.stage} outside {self.size} stages")

    @property
    def size(self) -> int:
        return max(1, len(self.stages))

    def layers(self, stage: int) -> tuple[int, int] | None:
        """The layer range a namespace of ``stage`` names (None: every layer)."""
        return self.stages[stage] if self.stages else None


NO_PIPELINE = Pipeline()


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group of a vLLM model, as kvtier stores it."""

    index: int
    """vLLM's KV cache group id (the position of its block ids in every block-id tuple)."""
    layout: KVLayout
    layer_names: tuple[str, ...]
    sliding_window: int | None = None
    """Tokens the next token attends to, itself included (``SlidingWindowSpec``)."""
    extra_retained_tokens: int = 0
    """Tokens vLLM keeps below the window (multi-token prediction re-prefill)."""
    attention_chunk_size: int | None = None
    """Tokens of one local-attention chunk (``ChunkedLocalAttentionSpec``)."""
    tp_replicas: int = 1
    """Consecutive tensor-parallel ranks that hold identical KV of this group."""
    tp_world: int = 1
    pipeline: Pipeline = NO_PIPELINE

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def windowed(self) -> bool:
        """Whether vLLM frees this group's blocks below a window while the request runs."""
        return self.sliding_window is not None or self.attention_chunk_size is not None

    @property
    def kind(self) -> str:
        if self.sliding_window is not None:
            return f"sliding window {self.sliding_window}"
        if self.attention_chunk_size is not None:
            return f"chunked local {self.attention_chunk_size}"
        return "full attention"

    def skipped_tokens(self, num_tokens: int) -> int:
        """Leading tokens the token after ``num_tokens`` does not attend to, as vLLM's
        ``get_num_skipped_tokens`` counts them: their blocks are null in vLLM's table."""
        if self.sliding_window is not None:
            return max(0, num_tokens - self.sliding_window + 1 - self.extra_retained_tokens)
        if self.attention_chunk_size is not None:
            return num_tokens // self.attention_chunk_size * self.attention_chunk_size
        return 0

    def first_needed_block(self, num_tokens: int) -> int:
        """The first block a hit of ``num_tokens`` needs (the earlier ones are null)."""
        return self.skipped_tokens(num_tokens) // self.block_size

    @property
    def tp_shards(self) -> int:
        """Distinct tensor-parallel shards of one stage's KV of this group."""
        return self.tp_world // self.tp_replicas

    def shard(self, rank: int) -> int:
        """The shard of this group's KV that tensor-parallel ``rank`` of this process's
        pipeline stage holds: the stages' shards follow one another."""
        return self.pipeline.stage * self.tp_shards + rank // self.tp_replicas

    def stores(self, rank: int) -> bool:
        """Whether ``rank`` stores its shard: the first rank holding it does."""
        return rank % self.tp_replicas == 0

    def shard_layouts(self) -> list[KVLayout]:
        """The layout of each shard, in shard order: its stage's layer count."""
        per_stage = [
            replace(self.layout, num_layers=count) for _, count in self.pipeline.stages
        ] or [self.layout]
        return [layout for layout in per_stage for _ in range(self.tp_shards)]

    def namespaces(self, model_id: str, fingerprint: bytes = b"") -> list[Namespace]:
        """One namespace per shard, in shard order."""
        layouts = self.shard_layouts()
        return [
            Namespace(
                model_id,
                layouts[stage * self.tp_shards + shard].signature,
                shard,
                self.tp_world,
                group=self.index,
                layers=self.pipeline.layers(stage),
                fingerprint=fingerprint,
            )
            for stage in range(self.pipeline.size)
            for shard in range(self.tp_shards)
        ]


def groups_from_kv_cache_config(
    kv_cache_config,
    tp_world: int = 1,
    dcp_world: int = 1,
    pcp_world: int = 1,
    pipeline: Pipeline = NO_PIPELINE,
) -> list[KVGroup]:
    """Every KV cache group of one rank's ``KVCacheConfig`` (of ``pipeline.stage``), or a
    ``ValueError`` saying why kvtier cannot serve this model."""
    if dcp_world > 1 or pcp_world > 1:
        raise ValueError(
            "KVTierConnector does not support decode or prefill context parallelism: it "
            "spreads a block's tokens over ranks, and kvtier names whole blocks"
        )
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ValueError("KVTierConnector has nothing to store: this model keeps no KV cache")
    if pipeline.stages:
        _check_stage_layers(groups, pipeline)
    return [_group(index, group, tp_world, pipeline) for index, group in enumerate(groups)]


def _check_stage_layers(groups, pipeline: Pipeline) -> None:
    """Refuses pipeline parallelism unless this stage's KV layers are its decoder layers, one
    each: only then does every stage's layout follow from its layer range."""
    why = (
        "KVTierConnector supports pipeline parallelism only for a model of one KV cache group "
        "with one KV layer per decoder layer (vLLM tells the scheduler the first stage's "
        "layers alone, so kvtier derives every other stage's from its layer range)"
    )
    if len(groups) > 1:
        raise ValueError(f"{why}; this model has {len(groups)} KV cache groups")
    first, count = pipeline.stages[pipeline.stage]
    names = list(groups[0].layer_names)
    indices = [_layer_index(name) for name in names]
    if indices != list(range(first, first + count)):
        raise ValueError(
            f"{why}; pipeline stage {pipeline.stage} holds decoder layers {first}.."
            f"{first + count - 1} but KV layers {names[:4]}{'...' if len(names) > 4 else ''}"
        )


def _layer_index(name: str) -> int | None:
    """The decoder layer a KV layer belongs to: the one number in its dotted name, as vLLM's
    ``extract_layer_index`` reads it (None: not exactly one)."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    return numbers[0] if len(numbers) == 1 else None


def alignment_tokens(groups: list[KVGroup]) -> int:
    """The granularity of a hit: whole blocks of every group (vLLM's scheduler block size)."""
    return math.lcm(*(group.block_size for group in groups))


def _group(index: int, group, tp_world: int, pipeline: Pipeline) -> KVGroup:
    spec = _one_spec(index, group.kv_cache_spec)
    kind = type(spec).__name__
    where = f"KV cache group {index} ({kind}, layers {list(group.layer_names)[:3]}...)"
    if kind in _WHY_NOT:
        raise ValueError(f"KVTierConnector cannot serve {where}: {_WHY_NOT[kind]}")
    if kind not in FULL_KINDS + WINDOW_KINDS + CHUNKED_KINDS:
        raise ValueError(
            f"KVTierConnector cannot serve {where}: kvtier knows which blocks a hit needs only "
            f"for {', '.join(FULL_KINDS + WINDOW_KINDS + CHUNKED_KINDS)}"
        )
    if not getattr(spec, "prefix_cacheable", True) or not getattr(
        group, "enable_kv_transfer", True
    ):
        raise ValueError(f"KVTierConnector cannot serve {where}: vLLM does not prefix-cache it")
    try:
        layout = layout_of_spec(spec, len(group.layer_names))
    except ValueError as exc:
        raise ValueError(f"KVTierConnector cannot serve {where}: {exc}") from exc
    window = chunk = None
    extra = 0
    if kind in WINDOW_KINDS:
        window, extra = spec.sliding_window, getattr(spec, "extra_retained_tokens", 0)
    elif kind in CHUNKED_KINDS:
        chunk = spec.attention_chunk_size
    # A full-attention spec may carry a window when vLLM's hybrid manager is off: vLLM then
    # keeps every block, and kvtier stores and loads every block, as for full attention.
    return KVGroup(
        index=index,
        layout=layout,
        layer_names=tuple(group.layer_names),
        sliding_window=window,
        extra_retained_tokens=extra,
        attention_chunk_size=chunk,
        tp_replicas=_tp_replicas(spec, tp_world),
        tp_world=tp_world,
        pipeline=pipeline,
    )


def _one_spec(index: int, spec):
    """The spec every layer of the group shares (vLLM may wrap per-layer specs)."""
    inner = getattr(spec, "kv_cache_specs", None)
    if inner is None:
        return spec
    specs = list(inner.values())
    if any(s != specs[0] for s in specs[1:]):
        raise ValueError(
            f"KVTierConnector cannot serve KV cache group {index}: its layers have pages of "
            "different shapes, and a kvtier block is one page shape per layer"
        )
    return specs[0]


def _tp_replicas(spec, tp_world: int) -> int:
    """Consecutive ranks holding identical KV, as vLLM's ``_layer_tp_replicas`` counts them
    (``max_tp_shards`` distinct shards at most; None: every rank its own)."""
    shards = getattr(spec, "max_tp_shards", None)
    if shards is None:
        return 1
    return max(1, tp_world // shards)
