"""Small HTTP servers on loopback, for the tests that make Iris fetch media by URL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietHandler(BaseHTTPRequestHandler):
    """HTTP/1.1, no access log on the test output; subclasses write do_GET with `_send`."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes = b"", headers=(), reason: str | None = None) -> None:
        self.send_response(status, reason)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextmanager
def http_server(handler: type[BaseHTTPRequestHandler], host: str = "127.0.0.1") -> Iterator[ThreadingHTTPServer]:
    """`handler` served on a free port of `host` from a thread of its own; shut down on exit."""
    httpd = ThreadingHTTPServer((host, 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
