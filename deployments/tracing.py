"""OpenTelemetry traces: one trace per request, one span per stage, exported over OTLP.

Off unless `tracing.otlp_endpoint` is set. Off, nothing of OpenTelemetry is imported or
created: `span` and `start_span` hand out one shared no-op span, `carrier` is None, and each
hook costs a truth test. On, every replica process has a TracerProvider of its own (set up by
its deployment's __init__) whose BatchSpanProcessor exports in the background.

The ingress's request span (RequestSpans, an ASGI middleware) is the root, or the child of a
client's `traceparent`. The context crosses Ray calls as a W3C carrier (`carrier()`, a
dict[str, str]) in the stage_io dataclasses, and each stage continues the trace with
`span(name, parent=carrier)`. LLMDecode turns vLLM's own tracing on (`vllm_engine_args`),
whose `llm_request` span is a child of the decode span through vLLM's `trace_headers`.
"""

from __future__ import annotations

import contextvars
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.tenancy.tenant import metric_tenant


class TracingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    otlp_endpoint: str | None = Field(
        None,
        description="Where spans go over OTLP, as vLLM's --otlp-traces-endpoint takes it: grpc "
        "`http://collector:4317`; http/protobuf the full URL `http://collector:4318/v1/traces`. None (the "
        "default): no tracing at all, at no cost. Set, every stage exports its spans (docs/operations.md: "
        "Traces) and vLLM its `llm_request` span.",
    )
    protocol: Literal["grpc", "http/protobuf"] = Field(
        "grpc",
        description="OTLP transport, for Iris's spans and vLLM's alike (vLLM reads it from "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, which LLMDecode sets from this).",
    )
    service_name: str = Field("iris", description="The spans' `service.name` resource attribute.")
    sample_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of requests traced (by trace id); a request whose client sent a `traceparent` "
        "follows the client's sampling decision.",
    )


_tracer = None  # the process's Tracer once setup() found an endpoint; None: tracing is off
_request_span: contextvars.ContextVar = contextvars.ContextVar("iris_request_span", default=None)


class _NoSpan:
    """What every hook hands out when tracing is off: a span that records nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def is_recording(self) -> bool:
        return False

    def set_attribute(self, key, value) -> None:
        pass

    def set_attributes(self, attributes) -> None:
        pass

    def end(self, end_time=None) -> None:
        pass


NO_SPAN = _NoSpan()


def setup(config: TracingConfig, process: str) -> None:
    """This replica process's tracer (`process`: its stage), once; nothing when no endpoint is set."""
    global _tracer
    if config.otlp_endpoint is None or _tracer is not None:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(
            endpoint=config.otlp_endpoint, insecure=not config.otlp_endpoint.startswith("https://")
        )
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint)
    # A provider of this process's own, not OpenTelemetry's global one: vLLM sets that one
    # in LLMDecode's process for its own spans.
    provider = TracerProvider(
        resource=Resource.create(
            {"service.name": config.service_name, "iris.stage": process, "process.pid": os.getpid()}
        ),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    import atexit

    atexit.register(provider.shutdown)  # what is still batched goes out when the replica stops
    _tracer = provider.get_tracer("iris")


def enabled() -> bool:
    return _tracer is not None


def span(name: str, parent: dict[str, str] | None = None):
    """A context manager: a span of the current trace, or of `parent`'s (a carrier from another
    process), current inside the block; it records an exception leaving the block."""
    if _tracer is None:
        return NO_SPAN
    return _tracer.start_as_current_span(name, context=_context(parent))


def start_span(name: str, parent: dict[str, str] | None = None):
    """A span that is not made current, for work that spans yields (an async generator): end it."""
    if _tracer is None:
        return NO_SPAN
    return _tracer.start_span(name, context=_context(parent))


def ended_span(name: str, start_ns: int, end_ns: int, attributes: dict) -> None:
    """A child of the current span for work already done elsewhere (an encoder batch's forward pass)."""
    if _tracer is None:
        return
    _tracer.start_span(name, start_time=start_ns, attributes=attributes).end(end_time=end_ns)


def carrier(of=None) -> dict[str, str] | None:
    """The W3C trace context (`traceparent`) of span `of`, else of the current span, for another process."""
    if _tracer is None:
        return None
    from opentelemetry import trace
    from opentelemetry.propagate import inject

    headers: dict[str, str] = {}
    inject(headers, context=trace.set_span_in_context(of) if of is not None else None)
    return headers


def tag_request(tenant: str | None = None, **attributes) -> None:
    """Attributes of the request's root span, named `iris.<name>`; the tenant hashed as metrics
    name it (pipeline/tenancy/tenant.py metric_tenant), never the name or key in clear."""
    if _tracer is None:
        return
    root = _request_span.get()
    if root is None:
        return
    if tenant is not None:
        root.set_attribute("iris.tenant", metric_tenant(tenant))
    root.set_attributes({f"iris.{k}": v for k, v in attributes.items() if v is not None})


def cache_outcome(cached: int, computed: int) -> str:
    """How a request's images were served: none (no media), hit, miss or partial."""
    if not cached and not computed:
        return "none"
    return "hit" if not computed else "miss" if not cached else "partial"


def vllm_engine_args(config: TracingConfig, engine_args: dict) -> dict:
    """vLLM's own tracing, to the same endpoint, unless engine_args sets it."""
    if config.otlp_endpoint is None or "otlp_traces_endpoint" in engine_args:
        return {}
    # vLLM's exporter takes its protocol and its spans' service name from the environment.
    os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = config.protocol
    os.environ.setdefault("OTEL_SERVICE_NAME", config.service_name)
    return {"otlp_traces_endpoint": config.otlp_endpoint}


def _health_check(path: str) -> bool:
    return path.endswith("/health") or "/-/" in path  # Iris's, Serve's (/-/healthz, /-/routes)


def _context(parent: dict[str, str] | None):
    if not parent:
        return None  # the current context
    from opentelemetry.propagate import extract

    return extract(parent)


class RequestSpans:
    """ASGI middleware: a root span per HTTP request but health checks, from its arrival to the last byte
    of its answer (streamed or not), the child of the client's `traceparent` if it sent one. Routes
    add attributes with `tag_request`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if _tracer is None or scope["type"] != "http" or _health_check(scope["path"]):
            return await self.app(scope, receive, send)
        from opentelemetry.trace import SpanKind, Status, StatusCode

        client = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k in (b"traceparent", b"tracestate")
        }
        with _tracer.start_as_current_span(
            "ingress.request",
            context=_context(client),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": scope["method"], "url.path": scope["path"]},
        ) as root:
            token = _request_span.set(root)

            async def send_traced(message):
                if message["type"] == "http.response.start":
                    root.set_attribute("http.response.status_code", message["status"])
                    if message["status"] >= 500:
                        root.set_status(Status(StatusCode.ERROR))
                await send(message)

            try:
                await self.app(scope, receive, send_traced)
            finally:
                _request_span.reset(token)
