"""iris_client against the running app (tiny LLaVA on CPU, real Redis, real vLLM): an image
uploads once, then goes by id with no bytes on the wire and no image work (the ingress's own
counters in /iris/stats: no fetch, no Preprocess call), answering the same (greedy); once the
cache lost it (its Redis key deleted, LLMDecode's memory of it dropped), the 409 is answered by
resending exactly the lost images, with the same answer; a content uuid is the server's own
content key, private to its tenant (the tenants app of test_serving_tenants).

Apps shared with other modules (conftest's APP_SHARING_ORDER): test_serving's LLaVA app and
test_serving_tenants' app."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import openai
import pytest
import redis

from bench.harness.systems import SERVED_NAME as NAME
from cache_service.keys import content_key, content_uuid, item_key
from iris_client import IrisClient, SentKeys
from iris_client import content_uuid as client_content_uuid
from tests.support.apps import reference_args
from tests.support.images import REFERENCE_TEXT, data_url, image_part, unique_png


@pytest.fixture(scope="module", params=["tenants", "llava"])
def app(request, iris_apps, tiny_checkpoint):
    """The running app: test_serving_tenants' (API keys) or test_serving's LLaVA one."""
    if request.param == "tenants":
        from tests.test_serving_tenants import APP, CONFIG, app_args

        with iris_apps.use(
            APP, app_args(tiny_checkpoint("llava")), route_prefix="/tenants", config=CONFIG, keep=True
        ) as running:
            yield running
    else:
        with iris_apps.use(
            "iris-llava", reference_args(tiny_checkpoint("llava"), "float32", NAME), keep=True, route_prefix="/llava"
        ) as running:
            yield running


llava = pytest.mark.parametrize("app", ["llava"], indirect=True)


class Wire:
    """An IrisClient whose requests' bodies are kept (openai's own HTTP client, with a hook)."""

    def __init__(self, app, tenant: str):
        import httpx2  # the openai client's HTTP library

        self.bodies: list[bytes] = []
        http = httpx2.Client(timeout=120, event_hooks={"request": [lambda r: self.bodies.append(r.content)]})
        self.client = IrisClient(
            openai_client=openai.OpenAI(
                base_url=f"{app.url}/v1",
                api_key="none",
                max_retries=0,
                http_client=http,
                default_headers={"X-Iris-Tenant": tenant},
            ),
            sent=SentKeys(),
        )

    def ask(self, *images: bytes, stream: bool = False):
        parts = [{"type": "image", "image": png} for png in images]
        messages = [{"role": "user", "content": [*parts, {"type": "text", "text": REFERENCE_TEXT}]}]
        r = self.client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=8, temperature=0, stream=stream
        )
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in r if c.choices), r.iris
        return r.choices[0].message.content, r.iris

    def images_in(self, body: bytes) -> list[dict]:
        return [p for p in json.loads(body)["messages"][0]["content"] if p["type"] == "image_url"]


def _work(app) -> tuple[int, int]:
    return app.stats("Preprocess")["images_preprocessed"], app.stats("VisionEncoder")["images_encoded"]


def _ingress(app) -> dict[str, int]:
    """The ingress's own counters (/iris/stats `ingress`): media fetched, Preprocess calls, requests.

    /iris/stats answers from whichever ingress replica the proxy picks; the LLaVA app runs one
    (build_app's default: serve_config.yaml's Ingress autoscaling applies to a config deploy only),
    checked here, so the counters read are those of the replica that served the requests."""
    from ray import serve

    replicas = serve.status().applications[app.name].deployments["Ingress"].replica_states
    assert replicas.get("RUNNING") == 1 and sum(replicas.values()) == 1, replicas
    stats = httpx.get(f"{app.url}/iris/stats", timeout=30)
    assert stats.status_code == 200, stats.text
    counts = stats.json()["ingress"]
    return {
        name: counts.get(name, 0)
        for name in ("media_fetched", "preprocess_calls", "requests_ok", "requests_cache_miss", "images_cached")
    }


def _moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters that moved, by how much."""
    return {name: after[name] - before[name] for name in after if after[name] != before[name]}


def _fingerprint(app) -> str:
    return app.handle("VisionEncoder").get_fingerprint.remote().result()


def _lose(app, tenant: str, png: bytes) -> None:
    """The cache loses the image: its Redis key (once written: the write follows the answer) and
    LLMDecode's memory of it (the ingress's memory it finds wrong by itself: the decode says so)."""
    key = content_key(_fingerprint(app), png, app.namespace, tenant)
    r = redis.Redis(host="127.0.0.1", port=6379)
    deadline = time.monotonic() + 30
    while not r.exists(key):
        assert time.monotonic() < deadline, f"{key} never reached Redis"
        time.sleep(0.1)
    assert r.delete(key) == 1
    assert app.handle("LLMDecode").forget_features.remote([key]).result() == 1


@llava
def test_an_image_sent_before_goes_by_id_with_no_bytes_and_no_work(app):
    wire, png = Wire(app, f"t-{uuid.uuid4().hex[:8]}"), unique_png()
    counted = _ingress(app)
    first, report = wire.ask(png)
    assert report.sent_as_id == 0 and report.bytes_sent > len(png)
    (part,) = wire.images_in(wire.bodies[-1])
    assert part["uuid"] == content_uuid(png) and part["image_url"]["url"] == data_url(png)
    # The upload: the ingress loaded its bytes and called Preprocess, once each.
    uploaded = _ingress(app)
    assert _moved(counted, uploaded) == {"media_fetched": 1, "preprocess_calls": 1, "requests_ok": 1}

    work = _work(app)
    for stream in (False, True):
        again, report = wire.ask(png, stream=stream)
        assert again == first  # greedy: the same answer from the cached features
        assert report.sent_as_id == 1 and report.bytes_sent == 0 and report.attempts == 1
        assert report.bytes_saved == len(data_url(png))
        assert wire.images_in(wire.bodies[-1]) == [{"type": "image_url", "image_url": None, "uuid": content_uuid(png)}]
        assert len(wire.bodies[-1]) < 2000 < len(png)  # the request is text: no image on the wire
    # The repeats: answered from the cache, with no fetch and no Preprocess call in the ingress.
    assert _moved(uploaded, _ingress(app)) == {"requests_ok": 2, "images_cached": 2}
    assert _work(app) == work  # nor any work in the stages


@llava
def test_after_the_cache_lost_one_of_two_images_only_it_is_resent(app):
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    wire, a, b = Wire(app, tenant), unique_png(), unique_png()
    fresh, _ = wire.ask(a, b)
    assert wire.ask(a, b)[1].sent_as_id == 2
    _lose(app, tenant, b)
    work, counted = _work(app), _ingress(app)
    answer, report = wire.ask(a, b)
    assert answer == fresh
    assert report.attempts == 2 and report.resent == [1] and report.sent_as_id == 1
    optimistic, resend = (wire.images_in(body) for body in wire.bodies[-2:])
    assert [p["image_url"] for p in optimistic] == [None, None]
    assert resend[0] == {"type": "image_url", "image_url": None, "uuid": content_uuid(a)}
    assert resend[1]["image_url"]["url"] == data_url(b) and report.bytes_sent == len(data_url(b))
    assert _work(app)[0] == work[0] + 1  # b alone was preprocessed again
    # The ingress: a 409, then one fetch and one Preprocess call, b's (a went by id both times).
    moved = _moved(counted, _ingress(app))
    assert (moved.get("requests_cache_miss"), moved.get("requests_ok")) == (1, 1), moved
    assert (moved.get("media_fetched"), moved.get("preprocess_calls")) == (1, 1), moved
    # One lost image of one: the same.
    _lose(app, tenant, a)
    answer, report = wire.ask(a)
    assert report.resent == [0] and wire.ask(a)[1].sent_as_id == 1


@llava
def test_a_content_uuid_names_the_servers_own_key_for_the_bytes(app):
    tenant, png = f"t-{uuid.uuid4().hex[:8]}", unique_png()
    assert client_content_uuid(png) == content_uuid(png)
    fingerprint = _fingerprint(app)
    assert item_key(
        fingerprint, tenant, client_content_uuid(png), None, namespace=app.namespace, content_owner=tenant
    ) == content_key(fingerprint, png, app.namespace, tenant)
    headers = {"X-Iris-Tenant": tenant}

    def chat(part: dict) -> httpx.Response:
        body = {
            "model": NAME,
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": REFERENCE_TEXT}]}],
        }
        return httpx.post(f"{app.url}/v1/chat/completions", json=body, headers=headers, timeout=120)

    # Bytes with no uuid at all (any OpenAI client), then the content uuid alone: a hit.
    plain = chat(image_part(data_url(png)))
    assert plain.status_code == 200, plain.text
    work = _work(app)
    by_hash = chat(image_part(None, content_uuid(png)))
    assert by_hash.status_code == 200 and by_hash.headers["x-iris-images"] == "cached=1,computed=0", by_hash.text
    assert by_hash.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    assert _work(app) == work
    # A malformed one is a 400 naming the uuid; bytes under another image's hash are refused.
    bad = chat(image_part(None, "blake3:" + "A" * 64))
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_content_uuid", bad.text
    assert bad.json()["error"]["param"] == "image[0].uuid" and bad.json()["error"]["type"] == "invalid_request_error"
    victim = unique_png()
    forged = chat(image_part(data_url(png), content_uuid(victim)))
    assert forged.status_code == 400 and forged.json()["error"]["code"] == "invalid_content_uuid", forged.text
    miss = chat(image_part(None, content_uuid(victim)))  # nothing was stored under the victim's key
    assert miss.status_code == 409 and miss.json()["error"]["missing"] == [0]
    assert _work(app) == work


@pytest.mark.parametrize("app", ["tenants"], indirect=True)
def test_another_tenant_naming_a_content_key_gets_a_409_not_the_image(app):
    from tests.test_serving_tenants import ALPHA_2, KEYS

    png = unique_png()

    def chat(key: str, part: dict) -> httpx.Response:
        body = {
            "max_tokens": 4,
            "temperature": 0,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": REFERENCE_TEXT}]}],
        }
        return httpx.post(
            f"{app.url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=120
        )

    alpha = IrisClient(base_url=f"{app.url}/v1", api_key=KEYS["alpha"], sent=SentKeys(), max_retries=0)
    ask = [{"role": "user", "content": [{"type": "image", "image": png}, {"type": "text", "text": REFERENCE_TEXT}]}]
    for sent_as_id in (0, 1):
        assert alpha.chat.completions.create(messages=ask, model="", max_tokens=4).iris.sent_as_id == sent_as_id
    assert chat(ALPHA_2, image_part(None, content_uuid(png))).status_code == 200  # alpha's other key: its tenant
    miss = chat(KEYS["beta"], image_part(None, content_uuid(png)))
    assert miss.status_code == 409, miss.text
    assert miss.json()["error"]["code"] == "mm_cache_miss" and miss.json()["error"]["missing"] == [0]
