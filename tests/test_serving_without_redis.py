"""The cache is an optimisation, never a dependency: with no Redis reachable the
app starts, answers correctly (features travel inline), and says it is degraded."""

from __future__ import annotations

import httpx
import pytest
from ray import serve

from bench.harness.systems import SERVED_NAME
from tests.cache_fixtures import free_port
from tests.support.images import REFERENCE_TEXT, data_url, image_part, png_bytes


@pytest.fixture(scope="module")
def app_without_redis(iris_apps, tiny_checkpoint):
    args = {
        "model": tiny_checkpoint("llava"),
        "engine_args": {"max_model_len": 2048, "enforce_eager": True},  # no torch.compile: a faster start
        "cache": {"redis_url": f"redis://127.0.0.1:{free_port()}/0"},  # nobody listens there
    }
    with iris_apps.use("iris-noredis", args, route_prefix="/noredis") as app:
        yield app.url, app.name


def _ask(base: str, url: str | None, uid: str | None = None, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": [image_part(url, uid), {"type": "text", "text": REFERENCE_TEXT}]}],
            "max_tokens": 16, "temperature": 0, **extra}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)


def test_serves_correctly_without_redis(app_without_redis, vllm_server):
    base, name = app_without_redis
    assert httpx.get(f"{base}/health", timeout=30).json() == {"status": "ok", "redis": False}
    reference = _ask(vllm_server("llava")[0], data_url(png_bytes("wide")), model=SERVED_NAME).json()
    reference = reference["choices"][0]["message"]["content"]
    first = _ask(base, data_url(png_bytes("wide")), uid="photo-1")
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["message"]["content"] == reference

    encoder = serve.get_deployment_handle("VisionEncoder", app_name=name)
    encoded = encoder.stats.remote().result()["images_encoded"]
    again = _ask(base, data_url(png_bytes("wide")), uid="photo-1")
    assert again.status_code == 200
    assert again.json()["choices"][0]["message"]["content"] == reference
    # The encoder's own in-process tier still saves the vision forward pass.
    assert encoder.stats.remote().result()["images_encoded"] == encoded


def test_upload_free_without_redis_is_a_clean_409(app_without_redis):
    base, _ = app_without_redis
    r = _ask(base, None, uid="photo-1")
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "mm_cache_miss" and r.json()["error"]["missing"] == [0]
