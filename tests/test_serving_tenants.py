"""Tenants as a boundary, through the app: API keys on every route, a key's tenant and its uuids,
per-tenant limits before any image work and across two ingress replicas, metrics per tenant, and
no key in any log of the run.

One app for the module: tiny LLaVA with keys from a file (mapped to tenant names) plus one inline
key, limits for three tenants, and two Ingress replicas (deployed from a Serve config)."""

from __future__ import annotations

import json
import re
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest

from pipeline.tenancy.tenant import metric_tenant
from tests.support.apps import CPU_NODE, metrics_text
from tests.support.images import REFERENCE_TEXT, data_url, image_part, unique_png
from tests.support.sse import DONE, sse_events

APP = "iris-tenants"
# New keys each run, so finding one in the logs can only mean this run logged it.
RUN = uuid.uuid4().hex[:12]
KEYS = {tenant: f"sk-{tenant}-{RUN}-{uuid.uuid4().hex}" for tenant in ("alpha", "beta", "conc", "images", "tokens")}
ALPHA_2 = f"sk-alpha2-{RUN}-{uuid.uuid4().hex}"  # alpha's second key
WRONG = f"sk-wrong-{RUN}-{uuid.uuid4().hex}"
ALL_KEYS = [*KEYS.values(), ALPHA_2, WRONG]
IMAGES_PER_MINUTE = 2
PROMPT_TOKENS_PER_MINUTE = 30


# The app's Serve config: tests/test_dashboard.py uses the same app (AppPool, conftest's APP_SHARING_ORDER).
CONFIG = {
    "import_path": "deployments.app:build_app",
    "runtime_env": {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
    # Both on the proxy's node: Serve's proxy prefers replicas on its own node, so one
    # replica elsewhere would see no traffic at all.
    "deployments": [
        {"name": "Ingress", "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5, "resources": {CPU_NODE: 1}}}
    ],
}


def app_args(checkpoint: str) -> dict:
    """The app's args; the keys file is this run's (named by RUN), so another module's args are the same."""
    keys_file = Path(tempfile.gettempdir()) / f"iris-test-api-keys-{RUN}.json"
    keys_file.write_text(json.dumps({**{t: [k] for t, k in KEYS.items()}, "alpha": [KEYS["alpha"], ALPHA_2]}))
    return {
        "model": checkpoint,
        "engine_args": {"max_model_len": 2048, "enforce_eager": True},
        "auth": {"api_keys_file": str(keys_file)},
        "tenant_limits": {
            "tenants": {
                "conc": {"max_concurrent_requests": 1},
                "images": {"images_per_minute": IMAGES_PER_MINUTE},
                "tokens": {"prompt_tokens_per_minute": PROMPT_TOKENS_PER_MINUTE},
            }
        },
    }


@pytest.fixture(scope="module")
def tenants_app(iris_apps, tiny_checkpoint):
    started = time.monotonic()
    # Kept for tests/test_dashboard.py, which conftest runs next.
    with iris_apps.use(
        APP, app_args(tiny_checkpoint("llava")), route_prefix="/tenants", config=CONFIG, keep=True
    ) as app:
        print(f"tenants app up in {time.monotonic() - started:.0f} s")
        yield app


def _auth(key: str | None) -> dict:
    return {"authorization": f"Bearer {key}"} if key else {}


def _chat(app, key: str | None, parts: list[dict] | None = None, **extra) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": (parts or []) + [{"type": "text", "text": REFERENCE_TEXT}]}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }
    return httpx.post(f"{app.url}/v1/chat/completions", json=body, headers=_auth(key), timeout=120)


def _complete(app, key: str | None, prompt: str = "Hello there", **extra) -> httpx.Response:
    return httpx.post(
        f"{app.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, **extra}, headers=_auth(key), timeout=120
    )


def _work(app) -> tuple[int, int]:
    return app.stats("Preprocess")["images_preprocessed"], app.stats("VisionEncoder")["images_encoded"]


def _assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, (r.status_code, r.text)
    assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "invalid_request_error"


def _assert_429(r: httpx.Response, limit: str) -> int:
    assert r.status_code == 429, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error" and error["limit"] == limit
    retry_after = int(r.headers["retry-after"])
    assert 1 <= retry_after <= 60
    return retry_after


def _within_one_minute(seconds_needed: float) -> None:
    """Per-minute limits count per clock minute: start a check with that much of the minute left."""
    left = 60 - time.time() % 60
    if left < seconds_needed:
        time.sleep(left + 0.5)


ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", "/iris/stats", None),
    ("POST", "/tokenize", {"prompt": "hello"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2}),
]
# What no route takes: unknown paths (the docs FastAPI would serve among them), a route's wrong method.
UNROUTED = [
    ("GET", "/docs", 404),
    ("GET", "/openapi.json", 404),
    ("GET", "/redoc", 404),
    ("POST", "/v1/nope", 404),
    ("GET", "/v1/chat/completions", 405),
    ("DELETE", "/v1/models", 405),
    ("PUT", "/health", 405),
]


@pytest.mark.parametrize("method, path, body", ROUTES, ids=[p for _, p, _ in ROUTES])
def test_every_route_needs_a_right_key(tenants_app, method, path, body):
    def call(headers: dict) -> httpx.Response:
        return httpx.request(method, f"{tenants_app.url}{path}", json=body, headers=headers, timeout=120)

    for headers in (
        {},
        _auth(WRONG),
        _auth(KEYS["alpha"][:-1]),
        {"authorization": f"Basic {KEYS['alpha']}"},
        {"x-api-key": KEYS["alpha"]},
    ):
        _assert_401(call(headers))
    for key in (KEYS["alpha"], ALPHA_2):
        r = call(_auth(key))
        assert r.status_code == 200, r.text


def test_the_routes_above_are_every_route_of_the_app():
    """A route added to the ingress without a key check, or without a case above, fails here."""
    from deployments.ingress import app

    routes = {(method, route.path) for route in app.routes for method in getattr(route, "methods", None) or ()}
    assert routes - {("GET", "/health")} == {(method, path) for method, path, _ in ROUTES}


@pytest.mark.parametrize("method, path, status", UNROUTED, ids=[f"{m} {p}" for m, p, _ in UNROUTED])
def test_unknown_paths_and_methods_need_a_key_too(tenants_app, method, path, status):
    def call(headers: dict) -> httpx.Response:
        return httpx.request(method, f"{tenants_app.url}{path}", headers=headers, timeout=60)

    for headers in ({}, _auth(WRONG)):
        _assert_401(call(headers))
    r = call(_auth(KEYS["alpha"]))
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["code"] == ("not_found" if status == 404 else "method_not_allowed") and path in error["message"]
    if status == 405:
        assert "allow" in r.headers


def test_health_stays_open(tenants_app):
    r = httpx.get(f"{tenants_app.url}/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_a_401_comes_before_any_work(tenants_app):
    before = _work(tenants_app)
    _assert_401(_chat(tenants_app, None, [image_part(data_url(unique_png()))]))
    _assert_401(_chat(tenants_app, WRONG, [image_part(data_url(unique_png()))]))
    assert _work(tenants_app) == before


def test_a_key_reaches_its_own_tenants_uuids_only(tenants_app):
    uid = f"photo-{uuid.uuid4().hex}"
    first = _chat(tenants_app, KEYS["alpha"], [image_part(data_url(unique_png()), uid)])
    assert first.status_code == 200, first.text
    # The other key of the same tenant finds it upload-free; another tenant's key does not.
    assert _chat(tenants_app, ALPHA_2, [image_part(None, uid)]).status_code == 200
    miss = _chat(tenants_app, KEYS["beta"], [image_part(None, uid)])
    assert miss.status_code == 409, miss.text
    assert miss.json()["error"]["code"] == "mm_cache_miss" and miss.json()["error"]["missing"] == [0]


def test_images_per_minute_refused_before_any_image_work_over_both_replicas(tenants_app):
    _within_one_minute(40)
    for _ in range(IMAGES_PER_MINUTE):
        r = _chat(tenants_app, KEYS["images"], [image_part(data_url(unique_png()))])
        assert r.status_code == 200, r.text
    before = _work(tenants_app)
    # Eight more, spread over both ingress replicas by the proxy: each refused, none decoded or encoded.
    for _ in range(8):
        _assert_429(_chat(tenants_app, KEYS["images"], [image_part(data_url(unique_png()))]), "images")
    # More images in one request than a minute allows: a 400, since waiting would not help.
    r = _chat(tenants_app, KEYS["images"], [image_part(data_url(unique_png())) for _ in range(IMAGES_PER_MINUTE + 1)])
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_images", r.text
    assert _work(tenants_app) == before
    # Other tenants are not limited by it; a text-only request of the same tenant passes.
    assert _chat(tenants_app, KEYS["beta"], [image_part(data_url(unique_png()))]).status_code == 200
    assert _chat(tenants_app, KEYS["images"]).status_code == 200


def test_prompt_tokens_per_minute(tenants_app):
    _within_one_minute(30)
    first = _complete(tenants_app, KEYS["tokens"], "Tell me a story about " * 10)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens"] > PROMPT_TOKENS_PER_MINUTE  # charged from the usage
    for _ in range(4):
        _assert_429(_complete(tenants_app, KEYS["tokens"]), "prompt_tokens")
        _assert_429(_chat(tenants_app, KEYS["tokens"]), "prompt_tokens")


def _stream(client: httpx.Client, app, key: str, tokens: int = 1900):
    body = {
        "prompt": "Once upon a time",
        "max_tokens": tokens,
        "min_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
    }
    return client.stream("POST", f"{app.url}/v1/completions", json=body, headers=_auth(key), timeout=120)


def test_concurrency_holds_over_both_replicas_and_streams_give_their_slot_back(tenants_app):
    """A long stream holds the tenant's one slot: every other request of the tenant is refused,
    whichever ingress replica takes it (a refusal seen after the stream ended would be a 200, so
    a slow machine cannot make this pass wrongly)."""
    with httpx.Client() as client:
        started = time.monotonic()
        with _stream(client, tenants_app, KEYS["conc"]) as held:
            assert held.status_code == 200
            text = held.iter_text()
            first = next(text)  # the stream is open: its slot is taken
            assert first.startswith("data:")
            for _ in range(4):
                _assert_429(_complete(tenants_app, KEYS["conc"]), "concurrency")
                _assert_429(_chat(tenants_app, KEYS["conc"], [image_part(data_url(unique_png()))]), "concurrency")
            assert _complete(tenants_app, KEYS["beta"]).status_code == 200  # other tenants: no limit
            events = sse_events([first, *text])
            assert events[-1] == DONE
        full_stream_s = time.monotonic() - started
        # Read to its end: the slot is back by the time [DONE] arrives.
        assert _complete(tenants_app, KEYS["conc"]).status_code == 200
        assert _complete(tenants_app, KEYS["conc"]).status_code == 200  # whole answers give it back too

        # A client that leaves mid-stream: the slot comes back when the stream closes.
        with _stream(client, tenants_app, KEYS["conc"]) as left:
            next(left.iter_text())
        left_at = time.monotonic()
    while (r := _complete(tenants_app, KEYS["conc"])).status_code == 429:
        assert time.monotonic() - left_at < 30, "the slot of a stream whose client left was not given back"
        time.sleep(0.1)
    assert r.status_code == 200, r.text
    freed_s = time.monotonic() - left_at
    print(f"a full stream took {full_stream_s:.1f} s; the slot of a left stream came back in {freed_s:.1f} s")
    if full_stream_s > 6:  # long enough to tell "cancelled" from "ran to its end"
        assert freed_s < full_stream_s / 2


def _samples(text: str, metric: str) -> list[tuple[dict, float]]:
    out = []
    for line in text.splitlines():
        if line.startswith("#") or metric not in line.split("{")[0]:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        out.append((labels, float(line.rsplit(" ", 1)[1])))
    return out


def test_metrics_per_tenant_hashed(tenants_app):
    """Requests, 401s and 429s per tenant on Serve's metrics endpoint, with hashed tenants; the
    429s of one tenant came from both ingress replicas (so the limits above held across them)."""
    images, conc = metric_tenant("images"), metric_tenant("conc")
    deadline = time.monotonic() + 90
    while True:
        text = metrics_text()
        requests = [(s, v) for s, v in _samples(text, "iris_tenant_requests") if s.get("application") == APP]
        limited = {(s["tenant"], s["outcome"]): v for s, v in requests if s.get("outcome") != "admitted"}
        replicas = {
            s.get("replica")
            for s, v in requests
            if s["tenant"] in (images, conc) and s["outcome"] == "rate_limited" and v > 0
        }
        ready = (
            limited.get(("none", "unauthorized"), 0) > 0
            and (images, "rate_limited") in limited
            and (conc, "rate_limited") in limited
            and len(replicas) == 2
        )
        if ready or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert ready, (limited, replicas)
    assert any(s["tenant"] == metric_tenant("alpha") and s["outcome"] == "admitted" for s, _ in requests)
    # Only 429s: the 400 of a request with more images than its minute allows is no rate limit.
    assert {s["limit"] for s, _ in _samples(text, "iris_tenant_rate_limited")} == {
        "images",
        "prompt_tokens",
        "concurrency",
    }
    tenant_lines = "\n".join(line for line in text.splitlines() if "iris_tenant" in line)
    for name in ("alpha", "beta", "conc", "images", "tokens"):
        assert f'tenant="{name}"' not in tenant_lines
    for key in ALL_KEYS:
        assert key not in text


def _session_logs() -> list[Path]:
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "logs"
    return [p for p in logs.rglob("*") if p.is_file()]


def test_no_key_in_any_log_or_redis_key(tenants_app):
    """Run last: every request above carried a key. None is in the Ray session's logs (drivers,
    workers, Serve's controller, proxy and replicas, access logs) nor in the app's Redis keys."""
    import redis

    files = _session_logs()
    assert any("ServeReplica" in p.name or "replica" in p.name for p in files), "no replica logs found"
    needles = [k.encode() for k in ALL_KEYS]
    found = []
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        found += [(path.name, needle[:12]) for needle in needles if needle in data]
    assert not found, found
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        names = b"\n".join(client.scan_iter(match=f"{tenants_app.namespace}:*", count=1000))
    finally:
        client.close()
    assert b":limits:" in names  # the limits' counters are there, under hashed tenants
    assert not [n for n in needles if n in names]
    # (Tenant names do appear in uuid keys, which are scoped per tenant by name: docs/security.md.)
    limits = [n for n in names.split(b"\n") if b":limits:" in n]
    assert not [n for n in limits if b"alpha" in n or b"conc" in n or b"images" in n.split(b"}")[0]], limits
