"""gRPC's own log lines at a bounded rate, so that a client cannot fill the disk through them.

grpcio logs some failures itself, with a full traceback each: a request the standard health or
reflection service cannot decode is one ("Unexpected [DecodeError] raised by servicer
method"), and any local client can send thousands a second. kvtier's own refusals are logged
once per kind per few seconds (``tiers.ratelog``); ``limit_grpc_logs`` holds gRPC's loggers to
the same rule: the first record of a kind passes with its traceback, repeats within
``interval_s`` are counted, and the next one that passes says how many there were.
"""

from __future__ import annotations

import logging
import threading
import time

from kvtier.service.tunables import TUNABLES

_MAX_KINDS = 256
_TEMPLATE_CHARS = 200


class RepeatFilter(logging.Filter):
    """Passes a record of a kind (logger, message template, exception type) at most once per
    ``interval_s``; the next one that passes counts the repeats held back."""

    def __init__(
        self, interval_s: float = TUNABLES.grpc_log_interval_s, max_kinds: int = _MAX_KINDS
    ):
        super().__init__()
        self.interval_s = interval_s
        self._max_kinds = max_kinds
        self._lock = threading.Lock()
        self._last: dict[tuple, float] = {}
        self._held: dict[tuple, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (
            record.name,
            str(record.msg)[:_TEMPLATE_CHARS],
            record.exc_info[0] if record.exc_info else None,
        )
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval_s:
                self._held[kind] = self._held.get(kind, 0) + 1
                return False
            if len(self._last) >= self._max_kinds:  # templates a peer could vary must not pile up
                self._last.clear()
                self._held.clear()
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        if held:
            # formatted here: appending a placeholder could clash with a literal % in the text
            record.msg = f"{record.getMessage()} (and {held} more like it not logged)"
            record.args = ()
        return True


def limit_grpc_logs(interval_s: float = TUNABLES.grpc_log_interval_s) -> RepeatFilter:
    """Puts one ``RepeatFilter`` on every logger of grpcio and its health and reflection
    packages (each module's logger exists once it is imported; a filter on a parent logger
    would not see its children's records). Idempotent; returns the filter."""
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.split(".")[0] in ("grpc", "grpc_health", "grpc_reflection")
    ]
    for logger in loggers:
        for existing in logger.filters:
            if isinstance(existing, RepeatFilter):
                return existing
    limiter = RepeatFilter(interval_s)
    for logger in loggers:
        logger.addFilter(limiter)
    return limiter
