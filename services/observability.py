"""What the gateway and the worker share to be observed: the ``/metrics`` + ``/health`` HTTP server each tier
runs on its own port, and the TTFT histogram buckets both use, so the gateway's client-side TTFT and the
worker's engine-side TTFT fall into the same buckets and can be compared (or subtracted) bucket by bucket.

It lives here, beside ``config.py`` and ``queue/``, because neither service may import the other's package:
the gateway never loads the worker's modules. Importing this module imports no torch and no FastAPI.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class MetricsServer:
    """``/metrics`` (Prometheus text) and ``/health`` (JSON from ``health()``; 503 when it says not ok)."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, health: Callable[[], dict]):
        registry_ = registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, status = generate_latest(registry_), CONTENT_TYPE_LATEST, 200
                elif path in ("/health", "/healthz"):
                    info = health()
                    body, ctype = json.dumps(info).encode(), "application/json"
                    status = 200 if info.get("status") == "ok" else 503
                else:
                    body, ctype, status = b"not found\n", "text/plain", 404
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # quiet: Prometheus scrapes often
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="metrics-http", daemon=True)

    def start(self) -> MetricsServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
