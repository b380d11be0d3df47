"""The statistics endpoint: ``/metrics`` (Prometheus text) and ``/stats`` (JSON) over HTTP.

A small threaded HTTP server on its own thread, bound to 127.0.0.1 unless told otherwise.
Both pages are built from the same snapshot function the gRPC ``Stats`` call uses.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)


class StatsServer:
    """Serves ``/metrics`` and ``/stats`` until ``close``; ``port`` is the bound port."""

    def __init__(
        self, host: str, port: int, registry: CollectorRegistry, snapshot: Callable[[], dict]
    ):
        handler = _handler(registry, snapshot)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvtier-stats-http", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _handler(
    registry: CollectorRegistry, snapshot: Callable[[], dict]
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            elif path == "/stats":
                body = json.dumps(snapshot(), indent=2).encode()
                self._reply(200, "application/json", body)
            else:
                self._reply(404, "text/plain", b"try /metrics or /stats\n")

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("stats http: " + format, *args)

    return Handler
