"""OpenTelemetry traces (deployments/tracing.py): one trace per request, a span per stage,
connected across Ray calls, received at an OTLP endpoint this process runs
(tests/support/otlp_receiver.py). The app is test_serving's LLaVA app, traced (reference_args):
conftest hands it from test_serving to here, so no app starts for these tests."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from bench.harness.systems import SERVED_NAME as NAME
from pipeline.tenancy.tenant import metric_tenant
from tests.support.apps import reference_args
from tests.support.images import REFERENCE_TEXT, data_url, image_part, unique_png
from tests.support.otlp_receiver import spans_of, trace_receiver

ROOT = Path(__file__).resolve().parent.parent
STAGES = {"ingress.request", "ingress.parse", "ingress.fetch", "ingress.cache_lookup", "decode", "decode.features"}
COMPUTED = {"preprocess", "encoder", "encoder.forward"}


def test_tracing_off_creates_nothing():
    """Without an endpoint nothing of OpenTelemetry is imported or set up, and every hook is the
    shared no-op (a fresh interpreter: the test process has OpenTelemetry loaded already)."""
    code = """
import sys
from deployments import tracing
tracing.setup(tracing.TracingConfig(), "ingress")
assert tracing._tracer is None and not tracing.enabled()
assert tracing.span("a") is tracing.start_span("b", {"traceparent": "x"}) is tracing.NO_SPAN
assert tracing.carrier() is None and tracing.vllm_engine_args(tracing.TracingConfig(), {}) == {}
with tracing.span("c") as s:
    assert not s.is_recording()
tracing.tag_request("acme", model="m")
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_grpc_export_and_context_across_processes():
    """tracing.protocol's default (gRPC) to a gRPC OTLP receiver here, from a process of its own as
    a replica is: a span continued from a carrier (what crosses a Ray call) and one started
    without being made current (LLMDecode's) are children of the span the carrier came from;
    what is batched leaves when the process exits; sample_ratio drops new traces, not a sampled parent's."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.extend(spans_of(request))
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    code = f"""
from deployments import tracing
tracing.setup(tracing.TracingConfig(otlp_endpoint="http://127.0.0.1:{port}", service_name="iris-test"), "ingress")
with tracing.span("stage.a"):
    carrier = tracing.carrier()
with tracing.span("stage.b", carrier) as b:
    assert b.is_recording()
tracing.start_span("stage.c", carrier).end()
# sample_ratio 0: a new trace is dropped (nothing recorded, nothing sent), a sampled parent's is followed.
tracing._tracer = None
tracing.setup(tracing.TracingConfig(otlp_endpoint="http://127.0.0.1:{port}", service_name="iris-test",
                                    sample_ratio=0), "ingress")
with tracing.span("dropped") as dropped:
    assert not dropped.is_recording() and not int(tracing.carrier()["traceparent"][-2:], 16) & 1  # not sampled
tracing.start_span("stage.d", carrier).end()
print(carrier["traceparent"])
"""
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=60,
        ).stdout
        _, trace_id, parent_id, flags = out.split()[-1].split("-")
    finally:
        server.stop(None)
    assert int(flags, 16) & 1  # sampled (sample_ratio 1)
    assert sorted((s.name, s.trace_id, s.parent_id, s.service) for s in received) == [
        ("stage.a", trace_id, "", "iris-test"),
        ("stage.b", trace_id, parent_id, "iris-test"),
        ("stage.c", trace_id, parent_id, "iris-test"),
        ("stage.d", trace_id, parent_id, "iris-test"),
    ]


@pytest.fixture(scope="module")
def app(iris_apps, tiny_checkpoint):
    """test_serving's LLaVA app (the same args: the pool hands over the running one)."""
    with iris_apps.use(
        "iris-llava", reference_args(tiny_checkpoint("llava"), "float32", NAME), keep=True, route_prefix="/llava"
    ) as running:
        yield running.url


def _chat(base: str, part: dict, headers: dict) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": REFERENCE_TEXT}]}],
        "max_tokens": 4,
        "temperature": 0,
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _tree(spans) -> dict[str, list[str]]:
    """Span name -> the names of its parents (a name may occur more than once)."""
    by_id = {s.span_id: s for s in spans}
    tree: dict[str, list[str]] = {}
    for s in spans:
        tree.setdefault(s.name, []).append(by_id[s.parent_id].name if s.parent_id in by_id else "")
    return tree


def _complete(spans, computed: bool) -> bool:
    names = {s.name for s in spans}
    return STAGES | {"llm_request"} | (COMPUTED if computed else set()) <= names


def test_one_connected_trace_per_request_with_a_span_per_stage(app):
    receiver = trace_receiver()
    uid, png, tenant = f"traced-{uuid.uuid4().hex}", unique_png(), f"tenant-{uuid.uuid4().hex[:8]}"
    client_span = {}  # the client's own span ids (sent as traceparent), by request

    def headers(case: str) -> dict:
        if case == "new":  # no client context: Iris's span is the root
            return {"X-Iris-Tenant": tenant}
        trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
        client_span[case] = (trace_id, span_id)
        return {"X-Iris-Tenant": tenant, "traceparent": f"00-{trace_id}-{span_id}-01"}

    new = _chat(app, image_part(data_url(png), uid), headers("new"))
    cached = _chat(app, image_part(data_url(png), uid), headers("cached"))
    upload_free = _chat(app, image_part(None, uid), headers("upload_free"))
    assert [r.headers["x-iris-images"] for r in (new, cached, upload_free)] == [
        "cached=0,computed=1",
        "cached=1,computed=0",
        "cached=1,computed=0",
    ]

    # The new image's trace: found by its request id, an attribute of its root.
    request_id = new.json()["id"]
    roots = receiver.wait(lambda: receiver.find("ingress.request", "iris.request_id", request_id))
    assert len(roots) == 1, roots
    traces = {
        "new": roots[0].trace_id,
        "cached": client_span["cached"][0],
        "upload_free": client_span["upload_free"][0],
    }
    spans = {
        case: receiver.wait(
            lambda t=t, c=case: (lambda s: s if _complete(s, c == "new") else None)(receiver.trace(t)), timeout_s=30
        )
        or receiver.trace(t)
        for case, t in traces.items()
    }
    for case, trace in spans.items():
        assert _complete(trace, case == "new"), (case, _tree(trace))
        by_id = {s.span_id: s for s in trace}
        # One root, and every other span's parent is in the trace: connected across the processes.
        outside = [s for s in trace if s.parent_id not in by_id]
        assert [s.name for s in outside] == ["ingress.request"], (case, _tree(trace))
        root = outside[0]
        # A client's traceparent is honoured: Iris's root is the child of the client's span.
        assert root.parent_id == (client_span[case][1] if case in client_span else ""), case
        assert root.attributes["iris.tenant"] == metric_tenant(tenant)  # hashed, never in clear
        assert tenant not in str([s.attributes for s in trace])
        assert root.attributes["http.response.status_code"] == 200
        assert {s.service for s in trace} == {"iris"}  # vLLM's span too (OTEL_SERVICE_NAME)
        tree = _tree(trace)
        for stage in ("ingress.parse", "ingress.fetch", "ingress.cache_lookup", "decode"):
            assert tree[stage] == ["ingress.request"], (case, tree)
        assert tree["decode.features"] == ["decode"]
        assert tree["llm_request"] == ["decode"]  # vLLM's own span, through trace_headers
        lookup = next(s for s in trace if s.name == "ingress.cache_lookup").attributes
        if case == "new":
            assert tree["preprocess"] == ["ingress.request"] and tree["encoder"] == ["ingress.request"]
            assert tree["encoder.forward"] == ["encoder"]
            forward = next(s for s in trace if s.name == "encoder.forward").attributes
            assert forward["iris.encoder.batch_size"] >= 1 and forward["iris.encoder.batch"] >= 1
            assert root.attributes["iris.cache"] == "miss"
            assert (root.attributes["iris.images_cached"], root.attributes["iris.images_computed"]) == (0, 1)
            assert lookup["iris.cache.misses"] == 1 and lookup["iris.cache.upload_free"] == 0
        else:
            assert not COMPUTED & set(tree), (case, tree)  # neither Preprocess nor the encoder ran
            assert root.attributes["iris.cache"] == "hit"
            assert (root.attributes["iris.images_cached"], root.attributes["iris.images_computed"]) == (1, 0)
            # Found in Redis or remembered as stored; nothing missing.
            assert lookup["iris.cache.known"] + lookup["iris.cache.redis_hits"] == 1
            assert lookup["iris.cache.misses"] == 0
            assert lookup["iris.cache.upload_free"] == (1 if case == "upload_free" else 0)
