"""An OTLP/HTTP trace receiver in the test process: what a collector (Jaeger, Tempo, the
OpenTelemetry Collector) is to Iris, holding the spans it was sent by trace id.

`trace_receiver()` starts the session's one receiver on first use (tests/support/apps.py
reference_args points the shared apps' `tracing.otlp_endpoint` at it)."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    service: str
    attributes: dict


class TraceReceiver:
    def __init__(self):
        self._spans: dict[str, list[Span]] = {}  # trace id -> its spans
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True, name="otlp-receiver").start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return list(self._spans.get(trace_id, []))

    def find(self, name: str, attribute: str, value) -> list[Span]:
        with self._lock:
            return [
                s
                for spans in self._spans.values()
                for s in spans
                if s.name == name and s.attributes.get(attribute) == value
            ]

    def wait(self, ready, timeout_s: float = 30.0):
        """`ready()`'s first truthy value, asked until the timeout (spans leave in batches)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = ready()
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.25)

    def _add(self, body: bytes) -> None:
        for span in spans_of(ExportTraceServiceRequest.FromString(body)):
            with self._lock:
                self._spans.setdefault(span.trace_id, []).append(span)

    def _handler(self):
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver._add(body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):  # quiet
                pass

        return Handler


def spans_of(request: ExportTraceServiceRequest) -> list[Span]:
    """The spans of one OTLP export (over HTTP or gRPC alike)."""
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            spans += [
                Span(
                    s.name,
                    s.trace_id.hex(),
                    s.span_id.hex(),
                    s.parent_span_id.hex(),
                    resource.get("service.name", ""),
                    _attributes(s.attributes),
                )
                for s in scope_spans.spans
            ]
    return spans


def _attributes(pairs) -> dict:
    out = {}
    for kv in pairs:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind else None
    return out


_RECEIVER: TraceReceiver | None = None
_START = threading.Lock()


def trace_receiver() -> TraceReceiver:
    global _RECEIVER
    with _START:
        if _RECEIVER is None:
            _RECEIVER = TraceReceiver()
        return _RECEIVER
