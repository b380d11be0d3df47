"""Warnings that cannot flood a log: one line per kind of trouble per few seconds.

A failure that repeats per block (a dead device, a full map, a closed tier) would otherwise log
thousands of lines a second. The first of a kind is logged at once; the repeats within
``interval_s`` are counted and the next line that gets through says how many there were.
"""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    """``warning(kind, msg, *args)`` on ``logger``, at most once per ``interval_s`` per kind."""

    def __init__(
        self, logger: logging.Logger, interval_s: float = 5.0, max_kinds: int = 1024
    ) -> None:
        self.interval_s = interval_s
        self._max_kinds = max_kinds
        self._logger = logger
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval_s:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            if len(self._last) >= self._max_kinds:  # kinds named by peers must not pile up
                self._last.clear()
                self._held.clear()
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        if held:
            msg += " (and %d more like it not logged)"
            args = (*args, held)
        self._logger.warning(msg, *args)
