"""The load-or-recompute gate: a hit is worth loading only if it arrives before the engine
could compute it again.

It weighs each tier's delivered rate (the daemon's measured disk and remote reads, a memory
copy's rate for the host tier) against the engine's prefill rate, observed step by step:
the tokens a step that prefills schedules, over the time until the next step is planned.
A hit lies along the prompt as host, then disk, then remote tokens; the gate takes it up to
the first tier that would deliver slower than the engine computes and leaves that tier's
part and everything after it to be recomputed. Until it knows both rates it takes the whole
hit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from kvtier.connector.tunables import TUNABLES
from kvtier.connector.vllm.hits import Hit


class LoadGate:
    """Which leading part of a hit loads faster than the engine recomputes it.

    ``bytes_per_token``: the KV bytes one token's load moves, over every KV cache group.
    """

    def __init__(self, bytes_per_token: float, clock: Callable[[], float] = time.monotonic):
        self.bytes_per_token = bytes_per_token
        self.clock = clock
        self.prefill_tokens_per_s: float | None = None
        self._last_plan: float | None = None
        self._last_tokens = 0
        """Tokens the step planned at ``_last_plan`` scheduled, if it prefilled (else 0)."""

    def observe_step(self, tokens: int, prefills: bool) -> None:
        """A step is being planned: the step planned before it has run (in a sync engine,
        its compute fills the time since). ``tokens``: this step's scheduled tokens;
        ``prefills``: whether any of them are prompt tokens (decode-only steps say nothing
        about the prefill rate)."""
        now = self.clock()
        if self._last_plan is not None and self._last_tokens and now > self._last_plan:
            rate = self._last_tokens / (now - self._last_plan)
            last = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = (
                rate if last is None else last + TUNABLES.prefill_weight * (rate - last)
            )
        self._last_plan, self._last_tokens = now, tokens if prefills else 0

    def cut(self, offer: Hit, read_bytes_per_s: Mapping[str, float]) -> tuple[int, dict[str, int]]:
        """(tokens of ``offer`` worth loading, tokens declined per tier); ``read_bytes_per_s``
        holds the disk and remote tiers' measured rates (a tier not measured yet is taken)."""
        prefill = self.prefill_tokens_per_s
        if prefill is None:
            return offer.tokens, {}
        rates = {"host": TUNABLES.host_bytes_per_s, **read_bytes_per_s}
        parts = [
            ("host", offer.host_tokens),
            ("disk", offer.disk_tokens),
            ("remote", offer.remote_tokens),
        ]
        taken = 0
        for i, (tier, tokens) in enumerate(parts):
            rate = rates.get(tier)
            if tokens and rate is not None and rate / self.bytes_per_token < prefill:
                return taken, {t: n for t, n in parts[i:] if n}
            taken += tokens
        return taken, {}
