"""Faults under load (issue 11): no Redis at start-up, Redis killed and restarted, a
replica of each stage killed mid-run, clients that leave, requests past their deadline.

One app (tiny LLaVA) on a private redis-server that this module may kill (the shared
Redis at 6379 is never touched); loopback only; every wait is bounded. The app's
`request_timeout_s` is short so that "never hangs" is checked in seconds. The app starts
while its Redis is down: the cache is an optimisation, never a dependency, so the first
tests check that it serves correctly without one; `redis_up` then starts Redis and waits
for the app to reconnect.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import os
import signal
import tempfile
import time
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
from ray import serve

from bench.harness.client import LoadClient
from bench.harness.metrics import parse
from bench.harness.systems import SERVED_NAME
from bench.harness.workloads import ImageSpec, WorkloadFactory
from tests.cache_fixtures import private_redis
from tests.support.apps import metrics_text, run_on_fresh_loop, running_app
from tests.support.images import REFERENCE_TEXT, data_url, image_part, png_bytes
from tests.support.sse import sse_events

APP = "iris-faults"
MODEL = "tiny-llava"
TIMEOUT_S = 8.0  # the app's request_timeout_s
LIMIT = 3000  # the app's max_tokens_limit (the built-in checkpoints' context is 4096 tokens)
FAILURE_CODES = {503: "replica_unavailable", 504: "timeout"}


@pytest.fixture(scope="module")
def redis_server():
    with private_redis() as server:
        server.kill()  # down when the app starts; redis_up starts it (same port)
        yield server


@pytest.fixture(scope="module")
def fault_app(iris_apps, tiny_checkpoint, redis_server):
    args = {
        "model": tiny_checkpoint("llava"),
        "served_model_name": MODEL,
        "request_timeout_s": TIMEOUT_S,
        "max_tokens_limit": LIMIT,
        "engine_args": {"max_model_len": 4096, "enforce_eager": True},  # no torch.compile: a faster start
        # Reconnect quickly, so recovery is seen within the test's bounds.
        "cache": {"redis_url": redis_server.url, "backoff_initial_s": 0.05, "backoff_max_s": 0.5},
    }
    # A compile cache of its own, empty: vLLM compiles its logprobs kernel on first use (17 s on
    # this box when cold), and LLMDecode must have done so before it takes traffic (the deadline
    # tests' first requests ask for logprobs), whatever earlier runs left in /tmp.
    with tempfile.TemporaryDirectory(prefix="iris-faults-inductor-", ignore_cleanup_errors=True) as compile_cache:
        config = {
            "import_path": "deployments.app:build_app",
            "runtime_env": {"env_vars": {"TORCHINDUCTOR_CACHE_DIR": compile_cache}},
        }
        with iris_apps.use(APP, args, route_prefix="/faults", config=config) as app:
            yield app.url


@pytest.fixture
def redis_up(fault_app, redis_server):
    """The app's base URL, with its Redis running and the app connected to it."""
    if redis_server.proc is None:
        redis_server.start()
    _wait_for(
        lambda: httpx.get(f"{fault_app}/health", timeout=10).json()["redis"],
        30,
        "the app connects to Redis",
        interval_s=0.2,
    )
    return fault_app


# --------------------------------------------------------------------------- helpers
def _stats(deployment: str) -> dict:
    return running_app(APP).stats(deployment, timeout_s=30)


def _ingress_counts(base: str) -> dict:
    return httpx.get(f"{base}/iris/stats", timeout=30).json()["ingress"]


def _wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(interval_s)


def _decode_idle() -> bool:
    s = _stats("LLMDecode")
    return s["generating"] == 0 and s["engine_unfinished"] == 0


def _chat_body(text: str = "Tell me everything.", *, images=(), **extra) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content + [{"type": "text", "text": text}]}],
        "temperature": 0,
        **extra,
    }


def _long_body(**extra) -> dict:
    """A generation far from done at TIMEOUT_S: LIMIT tokens, each with 20 top logprobs (15-18 s on
    the 2-core box once; plain tokens alone took 7.4 s there, too close to the deadline). The same
    box has also done it in 4.5 s: tests that need it to outlast the deadline ask for more choices
    (_outlasting_body)."""
    return _chat_body(max_tokens=LIMIT, ignore_eos=True, logprobs=True, top_logprobs=20, **extra)


def _outlasting_body(**extra) -> dict:
    """_long_body with sixteen choices (sampled: vLLM refuses n > 1 when greedy), decoded together: each
    more choice added ≈2.3 s here once (one: 4.5 s, two: 6.8 s), and six finished inside TIMEOUT_S
    once token deltas travelled every 50 ms behind HAProxy; sixteen stay past it even on an idle machine."""
    return _long_body(n=16, temperature=1.0, seed=0, **extra)


def _big_images(seed: int, n: int = 4) -> list[str]:
    return [ImageSpec(seed + i, 4000, 3000).data_url for i in range(n)]  # 12 MP JPEGs: slow to preprocess


def _assert_openai_error(error: dict, status: int) -> None:
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert error["code"] == FAILURE_CODES[status] and error["type"] == "server_error", error


class _RawRequest:
    """A POST on a plain socket, so a test can drop the connection whenever it likes."""

    def __init__(self, base: str, path: str, body: dict):
        url = urlsplit(base)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        self.conn.request("POST", url.path + path, json.dumps(body), {"content-type": "application/json"})

    def disconnect(self) -> None:
        self.conn.sock.shutdown(2)
        self.conn.close()


def _replica_processes(deployment: str) -> list[psutil.Process]:
    """Live replica processes of a deployment (Ray titles them ray::ServeReplica:APP:DEPLOYMENT)."""
    title = f"ray::ServeReplica:{APP}:{deployment}"
    found = []
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            name = (proc.cmdline() or [""])[0]
            # (a replica running a task is titled ray::ServeReplica:APP:DEPLOYMENT.method)
            if proc.status() != psutil.STATUS_ZOMBIE and (name == title or name.startswith(title + ".")):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def _scrape_metrics() -> list:
    return parse(metrics_text())


def _new_images(seed: int):
    """Endless single-turn conversations, each with an image never sent before."""
    for i in itertools.count():
        yield i, WorkloadFactory(seed=seed + i, small_px=96).unique(1).conversations[0]


def _mixed(seed: int):
    """Endless conversations: repeats of a few hot images, new images and text only."""
    factory = WorkloadFactory(seed=seed, small_px=96)
    pool = factory.zipf(200, repeat_share=0.6).conversations + factory.text(40).conversations
    return enumerate(itertools.cycle(pool))


async def _load_while(base: str, conversations, concurrency: int, scenario):
    """Runs a closed-loop load while `scenario()` (a coroutine) injects faults; returns the records."""
    done = False
    client = LoadClient([base], MODEL, timeout_s=TIMEOUT_S + 15)  # a hang shows as a client timeout
    load = asyncio.ensure_future(client.closed_loop_until(conversations, 16, concurrency, lambda: done))
    try:
        result = await scenario()
    finally:
        done = True
        records, _ = await load
    return records, result


# --------------------------------------------------------------------------- limits
def test_max_tokens_over_the_limit_is_400(fault_app):
    base = fault_app
    for field in ("max_tokens", "max_completion_tokens"):
        r = httpx.post(f"{base}/v1/chat/completions", json=_chat_body(**{field: LIMIT + 1}), timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and error["code"] == "invalid_value", error
        assert error["type"] == "invalid_request_error" and str(LIMIT) in error["message"]
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": LIMIT + 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    ok = httpx.post(f"{base}/v1/chat/completions", json=_chat_body(max_tokens=4), timeout=60)
    assert ok.status_code == 200, ok.text


# --------------------------------------------------------------------------- no Redis (the app started without)
def _ask(base: str, url: str | None, uid: str | None = None, **extra) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": [image_part(url, uid), {"type": "text", "text": REFERENCE_TEXT}]}],
        "max_tokens": 16,
        "temperature": 0,
        **extra,
    }
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)


def test_serves_correctly_without_redis(fault_app, vllm_server):
    base = fault_app
    assert httpx.get(f"{base}/health", timeout=30).json() == {"status": "ok", "redis": False}
    reference = _ask(vllm_server("llava")[0], data_url(png_bytes("wide")), model=SERVED_NAME).json()
    reference = reference["choices"][0]["message"]["content"]
    first = _ask(base, data_url(png_bytes("wide")), uid="photo-1")
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["message"]["content"] == reference

    encoded = _stats("VisionEncoder")["images_encoded"]
    again = _ask(base, data_url(png_bytes("wide")), uid="photo-1")
    assert again.status_code == 200
    assert again.json()["choices"][0]["message"]["content"] == reference
    # The encoder's own in-process tier still saves the vision forward pass.
    assert _stats("VisionEncoder")["images_encoded"] == encoded


def test_upload_free_without_redis_is_a_clean_409(fault_app):
    r = _ask(fault_app, None, uid="photo-1")
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "mm_cache_miss" and r.json()["error"]["missing"] == [0]


# --------------------------------------------------------------------------- deadlines and disconnects
def test_streamed_timeout_ends_the_stream_in_band(redis_up):
    """The app's first request with logprobs. Without LLMDecode's warm-up, vLLM compiled its
    logprobs kernel inside this request (9-17 s with the app's cold compile cache): no first
    token within the deadline, so a 504 status instead of the in-band error under test (three
    CI runs failed so, 2026-12-01/02)."""
    base = redis_up
    started = time.monotonic()
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=_outlasting_body(stream=True), timeout=TIMEOUT_S + 30
    ) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_text())
    elapsed = time.monotonic() - started
    assert events[-1] == "[DONE]" and TIMEOUT_S - 0.5 <= elapsed <= TIMEOUT_S + 5, (events[-3:], elapsed)
    _assert_openai_error(json.loads(events[-2])["error"], 504)
    _wait_for(_decode_idle, 3, "vLLM aborted the timed-out request")


def test_timeout_is_504_and_aborts_the_decode(redis_up):
    base = redis_up
    started = time.monotonic()
    r = httpx.post(f"{base}/v1/chat/completions", json=_outlasting_body(), timeout=TIMEOUT_S + 30)
    elapsed = time.monotonic() - started
    assert r.status_code == 504, r.text
    _assert_openai_error(r.json()["error"], 504)
    assert TIMEOUT_S - 0.5 <= elapsed <= TIMEOUT_S + 5, elapsed
    _wait_for(_decode_idle, 3, "vLLM aborted the timed-out request")


# --------------------------------------------------------------------------- clients that leave
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_client_disconnect_aborts_the_decode(redis_up, stream):
    """A client that leaves ends its decode: LLMDecode counts a generate() call whose caller went
    away (not LIMIT tokens finished). A streamed request's abort comes from the disconnect itself
    (15-125 ms here): the ingress answered no 504, the deadline's way of ending it. A non-streamed
    request's does too as a rule (18-165 ms; 5 of 5 tries through HAProxy, 6 of 6 straight to the
    Ingress replica), but behind HAProxy the first one after
    a streamed request's disconnect ran on until its deadline in 3 of 4 tries (2026-12-04,
    docs/api.md); so for it the test holds the deadline's bound only. The old fixed 3 s window
    also failed CI by 6 ms (2026-12-03)."""
    left_early = _stats("LLMDecode")["left_early"]
    timeouts = _ingress_counts(redis_up).get("requests_server_error", 0)
    request = _RawRequest(redis_up, "/v1/chat/completions", _long_body(stream=stream))
    try:
        _wait_for(lambda: _stats("LLMDecode")["generating"] == 1, 10, "the decode started")
        time.sleep(0.5)
        assert _stats("LLMDecode")["engine_unfinished"] == 1  # still generating: far from LIMIT tokens
    finally:
        request.disconnect()
    _wait_for(
        lambda: _decode_idle() and _stats("LLMDecode")["left_early"] == left_early + 1,
        TIMEOUT_S + 5,
        "vLLM aborted the abandoned request",
    )
    if stream:
        assert _ingress_counts(redis_up).get("requests_server_error", 0) == timeouts, "the deadline ended it"


def test_client_disconnect_stops_image_work(redis_up):
    """A client gone while its new images are preprocessed: the encoder never encodes them
    (its queued call is cancelled); no stage has work in progress for it afterwards."""
    encoded_before = _stats("VisionEncoder")["images_encoded"]
    request = _RawRequest(
        redis_up,
        "/v1/chat/completions",
        _chat_body("What is in these?", images=_big_images(seed=int(time.time())), max_tokens=4),
    )
    try:
        _wait_for(lambda: _stats("Preprocess")["preprocessing"] > 0, 20, "preprocessing started", interval_s=0.02)
    finally:
        request.disconnect()
    _wait_for(
        lambda: _stats("Preprocess")["preprocessing"] == 0 and _stats("VisionEncoder")["encoding"] == 0,
        5,
        "image work stopped",
    )
    time.sleep(3)  # long enough for the encoder to have run, had its call survived
    assert _stats("VisionEncoder")["images_encoded"] == encoded_before
    assert _decode_idle()


# --------------------------------------------------------------------------- Redis
def test_redis_killed_and_restarted_under_load(redis_up, redis_server):
    base = redis_up
    marks: dict[str, float] = {}

    async def health_redis() -> bool:
        async with httpx.AsyncClient() as client:
            return (await client.get(f"{base}/health", timeout=10)).json()["redis"]

    async def until(predicate, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while not await predicate():
            assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
            await asyncio.sleep(0.1)

    async def outage():
        t0 = time.perf_counter()
        await asyncio.sleep(3)
        redis_server.kill()
        marks["kill"] = time.perf_counter() - t0
        await until(lambda: _not(health_redis()), 5, "/health says Redis is down")
        await asyncio.sleep(4)
        redis_server.start()  # same port, empty: no persistence
        marks["restart"] = time.perf_counter() - t0
        await until(health_redis, 10, "/health says Redis is back")
        await asyncio.sleep(4)

    records, _ = run_on_fresh_loop(_load_while(base, _mixed(seed=int(time.time())), 4, outage))
    failed = [(round(r.start_s, 2), r.status, r.error[:300]) for r in records if not r.ok]
    assert not failed, (marks, failed[:3])
    # The load ran through the outage and after it (start_s is close to the runner's t0).
    assert sum(marks["kill"] < r.start_s < marks["restart"] for r in records) >= 5
    assert sum(r.start_s > marks["restart"] + 1 for r in records) >= 5

    ingress = httpx.get(f"{base}/iris/stats", timeout=10).json()["cache"]
    encoder = _stats("VisionEncoder")["cache"]
    for cache in (ingress, encoder):
        assert cache["degraded_transitions"] >= 1 and cache["reconnects"] >= 1 and cache["degraded"] == 0, cache

    def metrics_recovered():
        samples = _scrape_metrics()
        transitions = [
            v
            for n, labels, v in samples
            if n == "ray_iris_feature_cache_events_total"
            and labels.get("event") == "degraded_transitions"
            and labels.get("application") == APP
        ]
        degraded = [
            v for n, labels, v in samples if n == "ray_iris_feature_cache_degraded" and labels.get("application") == APP
        ]
        return sum(transitions) >= 1 and degraded and not any(degraded)

    _wait_for(metrics_recovered, 40, "Prometheus shows the outage and the recovery", interval_s=2)


async def _not(coro) -> bool:
    return not await coro


# --------------------------------------------------------------------------- replicas killed
def _outcome_problems(records) -> list[dict]:
    """Records that failed other than with a clean 503/504 in OpenAI's shape (in-band once streaming)."""
    problems = []
    for r in records:
        if r.ok:
            continue
        try:
            error = json.loads(r.error)
            error = error.get("error", error)
            status = r.status if r.status in FAILURE_CODES else {v: k for k, v in FAILURE_CODES.items()}[error["code"]]
            _assert_openai_error(error, status)
        except (ValueError, KeyError, AssertionError):
            problems.append(r.to_dict())
    return problems


def _wait_replaced(deployment: str, victim: psutil.Process, bound_s: float = 600) -> float:
    """Seconds until Serve runs a replacement for the killed `victim` and says the deployment is healthy."""
    killed = time.monotonic()
    while True:
        status = serve.status().applications[APP].deployments[deployment].status
        fresh = [p for p in _replica_processes(deployment) if p.pid != victim.pid]
        if fresh and status == "HEALTHY":
            return time.monotonic() - killed
        # (vLLM starts in ~40 s on an idle 2-core box; it took over 5 min at load average 28)
        assert time.monotonic() - killed < bound_s, f"{deployment} not replaced: {status}"
        time.sleep(0.5)


@pytest.mark.parametrize("deployment", ["Preprocess", "VisionEncoder", "LLMDecode"])
def test_replica_killed_mid_run(redis_up, deployment):
    base = redis_up
    [victim] = _replica_processes(deployment)
    engine_processes = victim.children(recursive=True)  # LLMDecode: vLLM's engine core
    outcome: dict = {}

    async def kill():
        long_request = None
        if deployment == "LLMDecode":  # certainly in flight when the replica dies
            long_request = asyncio.ensure_future(
                asyncio.to_thread(httpx.post, f"{base}/v1/chat/completions", json=_long_body(), timeout=TIMEOUT_S + 30)
            )
        await asyncio.sleep(2)
        victim.send_signal(signal.SIGKILL)
        # Serve notices and starts a replacement; wait until it serves.
        outcome["replaced_after_s"] = await asyncio.to_thread(_wait_replaced, deployment, victim)
        await asyncio.sleep(2)
        if long_request is not None:
            outcome["long"] = await long_request

    try:
        records, _ = run_on_fresh_loop(_load_while(base, _new_images(seed=int(time.time())), 3, kill))
        problems = _outcome_problems(records)
        assert not problems, problems[:3]
        if "long" in outcome:
            assert outcome["long"].status_code == 503, outcome["long"].text
            _assert_openai_error(outcome["long"].json()["error"], 503)
        # Later requests succeed, through every stage (new images).
        for i in range(4):
            body = _chat_body(images=[ImageSpec(int(time.time()) * 10 + i, 96, 96).data_url], max_tokens=8)
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        assert httpx.get(f"{base}/health", timeout=10).json()["status"] == "ok"
        print(
            f"{deployment}: {len(records)} requests, {sum(not r.ok for r in records)} failed cleanly, "
            f"replaced after {outcome['replaced_after_s']:.1f} s"
        )
    finally:
        # The killed replica's own children (vLLM's engine core) must not outlive it.
        gone, alive = psutil.wait_procs(engine_processes, timeout=30)
        for proc in alive:
            proc.kill()
    assert not alive, f"processes of the killed replica still running: {[p.pid for p in alive]}"
