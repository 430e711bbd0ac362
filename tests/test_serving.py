"""The Iris app over real HTTP: started with serve.run on CPU with the tiny
checkpoints, real Redis, real vLLM. One app per family, shared by all tests."""

from __future__ import annotations

import io
import uuid

import httpx
import pytest
from PIL import Image
from ray import serve

from bench.harness.systems import (
    SERVED_NAME as NAME,  # the served model name of the shared apps
)
from tests.support.apps import metrics_text, reference_args, running_app
from tests.support.images import REFERENCE_TEXT, data_url, png_bytes
from tests.support.images import image_part as _image_part
from tests.support.images import unique_png as _unique_png
from tests.support.sse import sse_events
from tests.support.videos import clip_bytes
from tests.support.videos import unique_clip as _unique_clip
from tests.support.videos import video_part as _video_part

# One family of each embedding form (one tensor per image; Qwen's embeddings + patch grid);
# every served family against `vllm serve` is tests/test_families.py.
FAMILIES = ["llava", "qwen2_vl"]


@pytest.fixture(scope="module", params=FAMILIES)
def app(request, iris_apps, tiny_checkpoint):
    """(family, base URL, app name): the app tests/test_api_parity.py and tests/test_families.py
    compare with `vllm serve` on the same checkpoint (conftest runs them one after another)."""
    family = request.param
    with iris_apps.use(
        f"iris-{family}", reference_args(tiny_checkpoint(family), "float32", NAME), keep=True, route_prefix=f"/{family}"
    ) as running:
        yield family, running.url, running.name


def _namespace_of(app_name: str) -> str:
    return running_app(app_name).namespace


def _stats(app_name: str, deployment: str) -> dict:
    return running_app(app_name).stats(deployment)


def _work_counts(app_name: str) -> tuple[int, int]:
    return (_stats(app_name, "Preprocess")["images_preprocessed"], _stats(app_name, "VisionEncoder")["images_encoded"])


def _chat(base: str, parts: list[dict], *, tenant: str | None = None, max_tokens: int = 8, **extra) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": parts + [{"type": "text", "text": REFERENCE_TEXT}]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    headers = {"X-Iris-Tenant": tenant} if tenant else {}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120)


def test_the_suite_serves_iris_behind_haproxy(app):
    """The suite's cluster runs Iris as the Quickstart does (conftest): the port the tests call is
    HAProxy's, not Serve's Python proxy's, and it answers."""
    from urllib.parse import urlparse

    import psutil

    _, base, _ = app
    port = urlparse(base).port
    listeners = {
        psutil.Process(c.pid).name()
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid
    }
    assert listeners == {"haproxy"}, listeners
    assert _chat(base, [_image_part(data_url(_unique_png()))]).status_code == 200


def test_same_bytes_skip_preprocess_and_encoder_and_hit_prefix_cache(app):
    _, base, name = app
    url = data_url(_unique_png())
    before = _work_counts(name)
    first = _chat(base, [_image_part(url)])
    assert first.status_code == 200, first.text
    assert first.headers["x-iris-images"] == "cached=0,computed=1"
    after_first = _work_counts(name)
    assert after_first == (before[0] + 1, before[1] + 1)

    second = _chat(base, [_image_part(url)])
    assert second.status_code == 200, second.text
    assert second.headers["x-iris-images"] == "cached=1,computed=0"
    assert _work_counts(name) == after_first  # neither Preprocess nor VisionEncoder ran
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]


def test_uuid_and_upload_free(app):
    _, base, name = app
    uid = f"sku-{uuid.uuid4().hex}"
    url = data_url(_unique_png())
    before = _work_counts(name)
    first = _chat(base, [_image_part(url, uid)])
    assert first.status_code == 200, first.text
    assert _work_counts(name) == (before[0] + 1, before[1] + 1)

    # The same uuid with the bytes again: cached by uuid, no work.
    again = _chat(base, [_image_part(url, uid)])
    assert again.headers["x-iris-images"] == "cached=1,computed=0"
    # Upload-free: the uuid alone.
    free = _chat(base, [_image_part(None, uid)])
    assert free.status_code == 200, free.text
    assert free.headers["x-iris-images"] == "cached=1,computed=0"
    assert free.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert free.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    assert _work_counts(name) == (before[0] + 1, before[1] + 1)


def test_upload_free_miss_is_409_and_computes_nothing(app):
    _, base, name = app
    before = _work_counts(name)
    known = f"known-{uuid.uuid4().hex}"
    assert _chat(base, [_image_part(data_url(_unique_png()), known)]).status_code == 200
    r = _chat(base, [_image_part(None, known), _image_part(None, f"never-sent-{uuid.uuid4().hex}")])
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "mm_cache_miss"
    assert error["missing"] == [1]
    assert _work_counts(name) == (before[0] + 1, before[1] + 1)  # only the first, successful request worked


def test_tenants_do_not_share_uuids(app):
    _, base, name = app
    uid = f"shared-id-{uuid.uuid4().hex}"
    url_a = data_url(_unique_png())
    assert _chat(base, [_image_part(url_a, uid)], tenant="tenant-a").status_code == 200
    assert _chat(base, [_image_part(None, uid)], tenant="tenant-a").status_code == 200
    # Tenant B guessing the id gets a miss, never A's features.
    r = _chat(base, [_image_part(None, uid)], tenant="tenant-b")
    assert r.status_code == 409 and r.json()["error"]["code"] == "mm_cache_miss"
    # With its own bytes under the same id, B's image is computed, not served from A's entry.
    before = _work_counts(name)
    r = _chat(base, [_image_part(data_url(_unique_png()), uid)], tenant="tenant-b")
    assert r.status_code == 200 and r.headers["x-iris-images"] == "cached=0,computed=1"
    assert _work_counts(name) == (before[0] + 1, before[1] + 1)


def test_content_keys_are_private_per_tenant_by_default(app):
    """share_content_cache_across_tenants is false: B cannot learn that A sent this image."""
    _, base, _ = app
    url = data_url(_unique_png())
    assert _chat(base, [_image_part(url)], tenant="tenant-a").headers["x-iris-images"] == "cached=0,computed=1"
    assert _chat(base, [_image_part(url)], tenant="tenant-b").headers["x-iris-images"] == "cached=0,computed=1"
    assert _chat(base, [_image_part(url)], tenant="tenant-a").headers["x-iris-images"] == "cached=1,computed=0"


def test_forged_redis_entries_are_recomputed_or_a_miss(app):
    """Valid codec values that are wrong for the model, written straight into Redis under the
    keys a request will use: never served; recomputed from the bytes, 409 when upload-free."""
    import redis
    import torch

    from cache_service.codec import encode
    from cache_service.features import Features
    from cache_service.keys import content_key, uuid_key
    from cache_service.validation import stamp_fingerprint

    _, base, name = app
    namespace = _namespace_of(name)
    fingerprint = serve.get_deployment_handle("VisionEncoder", app_name=name).get_fingerprint.remote().result()
    client = redis.Redis(host="127.0.0.1", port=6379)
    png = _unique_png()
    wrong_shape = stamp_fingerprint(Features({"image_embeds": torch.zeros(3, 7)}, {"num_tokens": 3}), fingerprint)
    reference = _chat(base, [_image_part(data_url(png))], tenant="tenant-ref")
    assert reference.status_code == 200, reference.text

    # The victim's content key holds a wrong-shape value; its uuid key one of another model.
    uid = f"forged-{uuid.uuid4().hex}"
    client.set(content_key(fingerprint, png, namespace, "tenant-v"), bytes(encode(wrong_shape)))
    other_model = stamp_fingerprint(Features({"image_embeds": torch.zeros(3, 7)}, {"num_tokens": 3}), "0ff1ce")
    client.set(uuid_key(fingerprint, "tenant-v", uid, namespace), bytes(encode(other_model)))
    rejected_before = _stats(name, "LLMDecode")["cache"]["rejected"]

    r = _chat(base, [_image_part(data_url(png))], tenant="tenant-v")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == reference.json()["choices"][0]["message"]["content"]
    r = _chat(base, [_image_part(None, uid)], tenant="tenant-v")
    assert r.status_code == 409 and r.json()["error"]["code"] == "mm_cache_miss", r.text
    assert _stats(name, "LLMDecode")["cache"]["rejected"] >= rejected_before + 2
    # The app still serves normally afterwards.
    assert _chat(base, [_image_part(data_url(png))], tenant="tenant-v").status_code == 200


def test_same_image_twice_in_one_request_is_encoded_once(app):
    _, base, name = app
    url = data_url(_unique_png())
    before = _work_counts(name)
    r = _chat(base, [_image_part(url), _image_part(url)])
    assert r.status_code == 200, r.text
    assert _work_counts(name) == (before[0] + 1, before[1] + 1)


def test_concurrent_burst_preprocesses_and_encodes_each_new_image_once(app):
    """Single-flight: 30 concurrent requests over 6 new images run Preprocess and VisionEncoder
    exactly once per distinct image."""
    import asyncio

    _, base, name = app
    urls = [data_url(_unique_png()) for _ in range(6)]

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            bodies = [
                {
                    "messages": [{"role": "user", "content": [_image_part(url), {"type": "text", "text": "hi"}]}],
                    "max_tokens": 2,
                    "temperature": 0,
                }
                for url in urls * 5
            ]
            return await asyncio.gather(*(client.post(f"{base}/v1/chat/completions", json=b) for b in bodies))

    before = _work_counts(name)
    replies = asyncio.run(burst())
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    preprocessed, encoded = (after - b for after, b in zip(_work_counts(name), before))
    assert preprocessed / len(urls) == 1.0 and encoded / len(urls) == 1.0
    computed = sum(int(r.headers["x-iris-images"].split("computed=")[1]) for r in replies)
    assert computed == len(urls)


def test_openai_client_streaming_and_not(app):
    from openai import OpenAI

    family, base, _ = app
    client = OpenAI(base_url=f"{base}/v1", api_key="test-key")
    assert [m.id for m in client.models.list()] == [NAME]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(png_bytes("tall"))}},
                {"type": "text", "text": REFERENCE_TEXT},
            ],
        }
    ]
    full = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.completion_tokens >= 1
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_raw_sse_ends_with_done(app):
    _, base, _ = app
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_text())
    assert events[-1] == "[DONE]"
    assert len(events) >= 3


BAD_REQUESTS = {
    "invalid base64": ([_image_part("data:image/png;base64,!!!not-base64!!!")], 400, "invalid_image"),
    "non-image bytes": ([_image_part(data_url(b"this is plain text, not an image"))], 400, "invalid_image"),
    "too many images": ([_image_part(data_url(png_bytes("square")))] * 3, 400, "too_many_images"),
    "too large image": ([_image_part(data_url(b"\x89PNG" + b"\0" * 300_000))], 400, "image_too_large"),
    "part without url or uuid": ([{"type": "image_url"}], 400, None),
    "unsupported scheme": ([_image_part("file:///etc/passwd")], 400, "invalid_image_url"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_a_4xx_in_openai_shape(app, case):
    _, base, _ = app
    parts, status, code = BAD_REQUESTS[case]
    r = _chat(base, parts)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if code:
        assert error["code"] == code


def test_image_the_model_cannot_take_is_400(app):
    """Qwen2-VL's processor refuses aspect ratios above 200; LLaVA crops any image to a square."""
    family, base, _ = app
    buf = io.BytesIO()
    Image.new("RGB", (600, 2), (10, 200, 30)).save(buf, format="PNG")
    r = _chat(base, [_image_part(data_url(buf.getvalue()))])
    if family == "llava":
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_image" and "aspect ratio" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        b'{"messages": []}',
        b'{"max_tokens": 5}',
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "five"}',
        b'{"messages": [{"role": "user", "content": "hi"}], "n": 0}',
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}',
    ],
)
def test_malformed_bodies_are_400(app, body):
    _, base, _ = app
    r = httpx.post(
        f"{base}/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"], error
    # Iris's own refusals (the body, its token limit) in OpenAI's words; the rest vLLM's, as `vllm serve` has them.
    assert (error["type"], error["code"]) in {
        ("invalid_request_error", "invalid_json"),
        ("invalid_request_error", "invalid_value"),
        ("Bad Request", 400),
        ("BadRequestError", 400),
    }, error


def test_unknown_model_is_404(app):
    _, base, _ = app
    r = httpx.post(
        f"{base}/v1/chat/completions",
        timeout=60,
        json={"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 404, r.text
    assert r.json()["error"]["type"] == "NotFoundError" and r.json()["error"]["param"] == "model", r.text


def test_replicas_survive_bad_input(app):
    """After all the bad requests above, the app still answers and no replica restarted."""
    _, base, name = app
    assert httpx.get(f"{base}/health", timeout=30).json()["status"] == "ok"
    r = _chat(base, [_image_part(data_url(png_bytes("square")))])
    assert r.status_code == 200, r.text
    status = serve.status().applications[name]
    assert status.status == "RUNNING"
    assert all(d.status == "HEALTHY" for d in status.deployments.values())


def test_prometheus_metrics_are_exported(app):
    """Iris's metrics reach Ray's Prometheus endpoint (exported every few seconds)."""
    import time

    _, base, _ = app
    url = data_url(_unique_png())
    for _ in range(2):  # the second one hits the feature cache and vLLM's prefix cache
        assert _chat(base, [_image_part(url)]).status_code == 200
    wanted = [
        "iris_requests",
        "iris_ttft_seconds",
        "iris_images",
        "iris_feature_cache_events",
        "iris_preprocess_seconds",
        "iris_encoder_batch_size",
        "iris_vllm_prefix_cache_hit_tokens",
    ]
    deadline = time.monotonic() + 60
    while True:
        text = metrics_text()
        missing = [name for name in wanted if name not in text]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not missing, f"metrics not exported: {missing}"
    assert 'outcome="ok"' in text


def test_oversized_body_is_413_without_reading_it_all(app):
    _, base, _ = app
    huge = (
        b'{"messages": [{"role": "user", "content": "' + b"x" * 8_000_000 + b'"}]}'
    )  # over the images' and video's room
    r = httpx.post(
        f"{base}/v1/chat/completions", content=huge, headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_keys_of_other_weights_are_refused_by_encoder_and_decoder(app):
    """A rolling update: an ingress still keying for the old weights gets 503 model_changed
    from the new replicas, never features of one model served to the other."""
    from cache_service.keys import content_key
    from pipeline.errors import IrisError
    from pipeline.model.vision_model import PixelInputs
    from pipeline.stage_io import DecodeCall

    _, base, name = app
    stale = content_key("0ff1ce", _unique_png(), _namespace_of(name))
    refused = (
        serve.get_deployment_handle("VisionEncoder", app_name=name).encode.remote(stale, PixelInputs(None, 1)).result()
    )
    assert isinstance(refused, IrisError) and refused.code == "model_changed" and refused.status_code == 503
    request = DecodeCall("chat", None, [stale], ["image"])
    chunks = list(serve.get_deployment_handle("LLMDecode", app_name=name).options(stream=True).generate.remote(request))
    assert len(chunks) == 1 and isinstance(chunks[0].error, IrisError)
    assert chunks[0].error.code == "model_changed" and chunks[0].error.status_code == 503
    # The ingress, asked normally, still answers.
    assert _chat(base, [_image_part(data_url(_unique_png()))]).status_code == 200


def test_lost_feature_reference_is_read_from_the_cache_or_reported_missing(app):
    """Features handed over by object-store reference are a shortcut: when fetching the
    reference fails as Ray failed it under heavy load (ReferenceCountingAssertionError, an
    ObjectLostError), LLMDecode falls back to the cache and reports what is missing, so the
    ingress recomputes it, instead of failing the request."""
    import ray
    from ray.exceptions import ReferenceCountingAssertionError

    from cache_service.keys import content_key
    from pipeline.stage_io import DecodeCall

    _, base, name = app

    @ray.remote(num_cpus=0)
    def lost_features():
        raise ReferenceCountingAssertionError("ab" * 28, "", "")

    fingerprint = serve.get_deployment_handle("VisionEncoder", app_name=name).get_fingerprint.remote().result()
    key = content_key(fingerprint, _unique_png(), _namespace_of(name), "default")
    request = DecodeCall("chat", None, [key], ["image"], delivered={key: lost_features.remote()})
    chunks = list(serve.get_deployment_handle("LLMDecode", app_name=name).options(stream=True).generate.remote(request))
    assert len(chunks) == 1 and chunks[0].missing_keys == [key] and not chunks[0].error
    assert _chat(base, [_image_part(data_url(_unique_png()))]).status_code == 200


# --- video (tiny Qwen2-VL; LLaVA-1.5 takes none) ---------------------------------------------

video_app = pytest.mark.parametrize("app", ["qwen2_vl"], indirect=True)


@pytest.mark.parametrize("app", ["llava"], indirect=True)
def test_video_to_a_model_without_video_is_400(app):
    _, base, name = app
    before = _work_counts(name)
    r = _chat(base, [_video_part(data_url(clip_bytes(), "video/mp4"))])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "unsupported_video" and "takes no video" in r.json()["error"]["message"]
    assert _work_counts(name) == before


@video_app
def test_video_data_url_is_encoded_once_then_cached(app):
    _, base, name = app
    url = data_url(_unique_clip(), "video/mp4")
    before = _work_counts(name)
    first = _chat(base, [_video_part(url)])
    assert first.status_code == 200, first.text
    assert first.headers["x-iris-images"] == "cached=0,computed=1"
    assert _work_counts(name) == (before[0] + 1, before[1] + 1)
    second = _chat(base, [_video_part(url)])
    assert second.headers["x-iris-images"] == "cached=1,computed=0"
    assert _work_counts(name) == (before[0] + 1, before[1] + 1)
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]


@video_app
def test_video_by_http_url_and_with_an_image(app):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    _, base, name = app
    clip = _unique_clip()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "video/mp4")
            self.send_header("Content-Length", str(len(clip)))
            self.end_headers()
            self.wfile.write(clip)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/clip.mp4"
        by_http = _chat(base, [_video_part(url), _image_part(data_url(_unique_png()))])
        assert by_http.status_code == 200, by_http.text
        assert by_http.headers["x-iris-images"] == "cached=0,computed=2"
        # The same bytes inline: the same content key, so no work at all.
        before = _work_counts(name)
        inline = _chat(base, [_video_part(data_url(clip, "video/mp4"))])
        assert inline.status_code == 200 and inline.headers["x-iris-images"] == "cached=1,computed=0"
        assert _work_counts(name) == before
    finally:
        httpd.shutdown()


def test_one_bad_image_stops_the_requests_other_fetches(app):
    """A request with an image at a slow URL and one whose URL answers 404 half a second later: the
    400 comes at once, and the slow fetch is cancelled (its server sees the connection closed long
    before it would answer, and before the fetch's own time limit)."""
    import select
    import socket
    import threading
    import time

    from tests.support.http_server import QuietHandler, http_server

    _, base, _ = app
    asked, closed = threading.Event(), threading.Event()

    class Server(QuietHandler):
        def do_GET(self):
            if self.path == "/missing.png":
                time.sleep(0.5)  # the slow fetch is under way by then
                return self._send(404)
            asked.set()
            until = time.monotonic() + 30
            while time.monotonic() < until:  # an answer 30 s late, unless the client leaves first
                if select.select([self.connection], [], [], 0.05)[0] and not self.connection.recv(1, socket.MSG_PEEK):
                    closed.set()
                    return
            self._send(200, png_bytes("square"), [("Content-Type", "image/png")])

    with http_server(Server) as httpd:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        started = time.monotonic()
        r = _chat(base, [_image_part(f"{url}/slow.png"), _image_part(f"{url}/missing.png")])
        answered_s = time.monotonic() - started
        assert r.status_code == 400 and r.json()["error"]["code"] == "image_fetch_failed", r.text
        assert answered_s < 5, answered_s
        assert asked.is_set(), "the slow image was never asked for"
        # Well before the fetch's own time limit (media.fetch_timeout_s, 10 s) would end it.
        assert closed.wait(3), "the slow image's fetch went on after the request's 400"
        print(
            f"400 in {answered_s:.2f} s; the slow fetch was closed {time.monotonic() - started:.2f} s after "
            "the request was sent"
        )


@video_app
def test_upload_free_video_hit_and_miss(app):
    _, base, name = app
    uid = f"clip-{uuid.uuid4().hex}"
    first = _chat(base, [_video_part(data_url(_unique_clip(), "video/mp4"), uid)])
    assert first.status_code == 200, first.text
    before = _work_counts(name)
    free = _chat(base, [_video_part(None, uid)])
    assert free.status_code == 200, free.text
    assert free.headers["x-iris-images"] == "cached=1,computed=0"
    assert free.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    # The uuid names a video: an image part with it is another item (vLLM's uuids are per modality).
    as_image = _chat(base, [_image_part(None, uid)])
    assert as_image.status_code == 409 and as_image.json()["error"]["missing"] == [0]
    miss = _chat(base, [_image_part(data_url(_unique_png())), _video_part(None, f"never-{uuid.uuid4().hex}")])
    assert miss.status_code == 409, miss.text
    assert miss.json()["error"]["code"] == "mm_cache_miss" and miss.json()["error"]["missing"] == [1]
    assert _work_counts(name) == before


BAD_VIDEOS = {
    "not a video": (lambda: b"this is plain text, not a video", "invalid_video", "video"),
    "truncated": (lambda: _unique_clip()[:3000], "invalid_video", "video"),
    "too many bytes": (lambda: _unique_clip() + b"\0" * 3_000_000, "video_too_large", "max_video_bytes"),
    "too long": (lambda: _unique_clip(frames=4, fps=0.005), "video_too_large", "max_video_duration_s"),
    "too many frames": (
        lambda: _unique_clip(frames=10_001, width=16, height=16, fps=30.0),
        "video_too_large",
        "max_video_frames",
    ),
}


@video_app
@pytest.mark.parametrize("case", list(BAD_VIDEOS))
def test_bad_video_is_400_naming_the_limit(app, case):
    _, base, name = app
    make, code, named = BAD_VIDEOS[case]
    before = _work_counts(name)
    r = _chat(base, [_video_part(data_url(make(), "video/mp4"))])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == code and named in error["message"] and error["param"] == "video[0]", error
    assert _work_counts(name)[1] == before[1]  # nothing reached the encoder
    ok = _chat(base, [_video_part(data_url(_unique_clip(), "video/mp4"))])  # the replica is fine
    assert ok.status_code == 200, ok.text


@video_app
def test_concurrent_burst_of_one_new_clip_encodes_it_once(app):
    import asyncio

    _, base, name = app
    url = data_url(_unique_clip(), "video/mp4")

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            body = {
                "messages": [{"role": "user", "content": [_video_part(url), {"type": "text", "text": "hi"}]}],
                "max_tokens": 2,
                "temperature": 0,
            }
            return await asyncio.gather(*(client.post(f"{base}/v1/chat/completions", json=body) for _ in range(12)))

    before = _work_counts(name)
    replies = asyncio.run(burst())
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    preprocessed, encoded = (after - b for after, b in zip(_work_counts(name), before))
    assert preprocessed == 1 and encoded / 1 == 1.0


@video_app
def test_new_clips_waiting_for_preprocess_hold_no_decode_slots(app):
    """LLMDecode is called once a request's encoder call is routed, which Serve does when the
    pixels exist: 16 new clips waiting for Preprocess do not wait in LLMDecode's slots (nor count
    in its autoscaling). A request holds one while its clip is encoded and decoded."""
    import asyncio
    import threading
    import time

    _, base, name = app
    # 10 s of 640x480 each (a quarter of a second to decode here): the clips queue in Preprocess.
    urls = [
        data_url(_unique_clip(frames=300, width=640, height=480, fps=30.0, smooth=True), "video/mp4") for _ in range(16)
    ]

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        f"{base}/v1/chat/completions",
                        json={
                            "messages": [{"role": "user", "content": [_video_part(u), {"type": "text", "text": "hi"}]}],
                            "max_tokens": 2,
                            "temperature": 0,
                        },
                    )
                    for u in urls
                )
            )

    replies: list = []
    sender = threading.Thread(target=lambda: replies.extend(asyncio.run(burst())))
    sender.start()
    generating, preprocessing = [], []
    while sender.is_alive():
        preprocessing.append(_stats(name, "Preprocess")["preprocessing"])
        generating.append(_stats(name, "LLMDecode")["generating"])
        time.sleep(0.05)
    sender.join()
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    assert max(preprocessing) >= 2, preprocessing  # the clips did queue for Preprocess (in it, or for its slots)
    # Preprocess takes one clip at a time here, so few are past it and not yet answered at once.
    assert 0 < max(generating) <= 3, generating


@video_app
def test_client_leaving_during_frame_decoding_leaves_the_stages_idle(app):
    """A clip whose decoding takes a while; the client leaves once Preprocess is working on it.
    The encoder never sees it, and every stage is idle again within 5 s."""
    import asyncio
    import contextlib
    import time

    _, base, name = app
    # 40 s of 640x480 (1.8 MB): about a second to decode and process here.
    clip = _unique_clip(frames=1200, width=640, height=480, fps=30.0, smooth=True)
    preprocess = serve.get_deployment_handle("Preprocess", app_name=name)
    before, abandoned = _work_counts(name), _stats(name, "Preprocess")["abandoned"]

    async def leave_while_preprocessing():
        async with httpx.AsyncClient(timeout=120) as client:
            request = asyncio.ensure_future(
                client.post(
                    f"{base}/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": [_video_part(data_url(clip, "video/mp4"))]}],
                        "max_tokens": 4,
                    },
                )
            )
            while (await preprocess.stats.remote())["preprocessing"] == 0:
                assert not request.done(), request.result().text
                await asyncio.sleep(0.01)
            request.cancel()  # closes the connection: the client is gone
            with contextlib.suppress(asyncio.CancelledError):
                await request

    asyncio.run(leave_while_preprocessing())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        busy = (
            _stats(name, "Preprocess")["preprocessing"],
            _stats(name, "VisionEncoder")["encoding"],
            _stats(name, "LLMDecode")["generating"],
        )
        if busy == (0, 0, 0):
            break
        time.sleep(0.1)
    assert busy == (0, 0, 0)
    assert _stats(name, "Preprocess")["abandoned"] == abandoned + 1  # it was dropped, not finished
    assert _work_counts(name) == before  # nothing preprocessed to the end, the encoder never ran for it
