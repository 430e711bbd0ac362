"""iris_client's logic against a stand-in server (tests/support/iris_stub.py): what goes on the
wire first and after a 409, content uuids, reports, streams, inputs. Fast. That the real Iris
answers the same way is tests/test_client.py's job."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest

from iris_client import AsyncIrisClient, CacheMissError, IrisClient, SentKeys, content_uuid
from tests.support.http_server import http_server
from tests.support.images import unique_png
from tests.support.iris_stub import IrisStub

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def stub():
    stub = IrisStub()
    with http_server(stub.handler()) as httpd:
        stub.url = f"http://127.0.0.1:{httpd.server_port}/v1"
        yield stub


def _client(stub, key="k1", **kw) -> IrisClient:
    return IrisClient(base_url=stub.url, api_key=key, sent=SentKeys(), max_retries=0, **kw)


def _ask(*images) -> list[dict]:
    return [{"role": "user", "content": [*images, {"type": "text", "text": "what?"}]}]


def _parts(body: dict) -> list[dict]:
    return [p for p in body["messages"][0]["content"] if p["type"] == "image_url"]


def test_first_upload_then_ids_only(stub):
    client, png = _client(stub), unique_png()
    first = client.chat.completions.create(model="m", messages=_ask({"type": "image", "image": png}))
    sent = _parts(stub.bodies[-1])[0]
    assert sent["uuid"] == content_uuid(png) and base64.b64decode(sent["image_url"]["url"].split(",")[1]) == png
    assert first.iris.sent_as_id == 0 and first.iris.bytes_sent == len(sent["image_url"]["url"])
    again = client.chat.completions.create(model="m", messages=_ask({"type": "image", "image": png}))
    assert _parts(stub.bodies[-1]) == [{"type": "image_url", "image_url": None, "uuid": content_uuid(png)}]
    assert again.iris.sent_as_id == 1 and again.iris.bytes_sent == 0
    assert again.iris.bytes_saved == first.iris.bytes_sent and again.iris.attempts == 1
    assert client.totals.requests == 2 and client.totals.bytes_saved == again.iris.bytes_saved


def test_a_miss_resends_exactly_the_missing_images_once(stub):
    client, a, b = _client(stub), unique_png(), unique_png()
    for png in (a, b):
        client.chat.completions.create(model="m", messages=_ask({"type": "image", "image": png}))
    stub.known.discard(("Bearer k1", content_uuid(b)))  # the server lost b
    reports = []
    client.on_report = reports.append
    r = client.chat.completions.create(
        model="m", messages=_ask({"type": "image", "image": a}, {"type": "image", "image": b})
    )
    optimistic, resend = _parts(stub.bodies[-2]), _parts(stub.bodies[-1])
    assert [p["image_url"] for p in optimistic] == [None, None]
    assert resend[0]["image_url"] is None and resend[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert r.iris.resent == [1] and r.iris.attempts == 2 and r.iris.sent_as_id == 1 and reports == [r.iris]


def test_a_second_miss_raises_with_the_indexes(stub):
    client = _client(stub)
    with pytest.raises(CacheMissError) as err:  # an id the client has no bytes for
        client.chat.completions.create(model="m", messages=_ask({"type": "image", "image": None, "uuid": "sku-9"}))
    assert err.value.missing == [0] and err.value.status_code == 409 and len(stub.bodies) == 1

    class Forgetful(IrisStub):  # loses what it is sent at once
        def answer(self, body, auth):
            status, answer = super().answer(body, auth)
            self.known.clear()
            return status, answer

    forgetful = Forgetful()
    with http_server(forgetful.handler()) as httpd:
        client = IrisClient(
            base_url=f"http://127.0.0.1:{httpd.server_port}/v1", api_key="k", sent=SentKeys(), max_retries=0
        )
        png = unique_png()
        client.chat.completions.create(model="m", messages=_ask({"type": "image", "image": png}))
        forgetful.answer = lambda body, auth: (
            409,
            {"error": {"code": "mm_cache_miss", "missing": [0], "message": "m", "type": "t", "param": None}},
        )
        with pytest.raises(CacheMissError) as err:
            client.chat.completions.create(model="m", messages=_ask({"type": "image", "image": png}))
        assert err.value.missing == [0]


def test_ids_are_per_server_and_key_and_the_lru_is_bounded(stub):
    sent, png = SentKeys(max_keys=2), unique_png()
    one = IrisClient(base_url=stub.url, api_key="k1", sent=sent, max_retries=0)
    two = IrisClient(base_url=stub.url, api_key="k2", sent=sent, max_retries=0)
    one.chat.completions.create(model="m", messages=_ask({"type": "image", "image": png}))
    assert two.chat.completions.create(model="m", messages=_ask({"type": "image", "image": png})).iris.sent_as_id == 0
    for _ in range(2):
        one.chat.completions.create(model="m", messages=_ask({"type": "image", "image": unique_png()}))
    assert len(sent) == 2  # the oldest went: it is sent with its bytes again, no 409 needed
    assert one.chat.completions.create(model="m", messages=_ask({"type": "image", "image": png})).iris.attempts == 1


def test_paths_pil_images_lazy_callables_urls_and_passed_through_parts(stub, tmp_path):
    from PIL import Image

    client, png = _client(stub), unique_png()
    path = tmp_path / "a.png"
    path.write_bytes(png)
    client.chat.completions.create(model="m", messages=_ask({"type": "image", "image": path}))
    assert _parts(stub.bodies[-1])[0]["uuid"] == content_uuid(png)
    pil = Image.new("RGB", (8, 8), (1, 2, 3))
    client.chat.completions.create(model="m", messages=_ask({"type": "image", "image": pil}))
    assert _parts(stub.bodies[-1])[0]["uuid"].startswith("blake3:")
    # A SKU with a loader: called only when the bytes must go.
    calls = []
    load = lambda: calls.append(1) or png  # noqa: E731
    for _ in range(3):
        client.chat.completions.create(model="m", messages=_ask({"type": "image", "image": load, "uuid": "sku-1"}))
    assert len(calls) == 1
    # A remote URL without fetch_urls goes as the URL (the server fetches it); with a uuid, by id after.
    url = "https://example.com/a.png"
    client.chat.completions.create(model="m", messages=_ask({"type": "image", "image": url, "uuid": "u-1"}))
    assert _parts(stub.bodies[-1])[0] == {"type": "image_url", "image_url": {"url": url}, "uuid": "u-1"}
    client.chat.completions.create(model="m", messages=_ask({"type": "image", "image": url, "uuid": "u-1"}))
    assert _parts(stub.bodies[-1])[0]["image_url"] is None
    # An OpenAI image_url part is passed through as it is, and counted in the indexes.
    own = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}
    r = client.chat.completions.create(model="m", messages=_ask(own, {"type": "image", "image": png}))
    assert _parts(stub.bodies[-1])[0] == own and r.iris.images == 2


def test_a_stream_carries_its_report(stub):
    client, png = _client(stub), unique_png()
    for expect in (0, 1):
        stream = client.chat.completions.create(model="m", stream=True, messages=_ask({"type": "image", "image": png}))
        assert "".join(c.choices[0].delta.content or "" for c in stream) == "1 images"
        assert stream.iris.sent_as_id == expect


async def test_async_client_streams_and_resends(stub):
    client, png = AsyncIrisClient(base_url=stub.url, api_key="k1", sent=SentKeys(), max_retries=0), unique_png()
    first = await client.chat.completions.create(model="m", messages=_ask({"type": "image", "image": png}))
    stub.known.clear()
    stream = await client.chat.completions.create(
        model="m", stream=True, messages=_ask({"type": "image", "image": png})
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == first.choices[0].message.content and stream.iris.resent == [0]
    await client.close()


def test_the_package_imports_no_server_library():
    """openai, httpx and blake3 only: no Ray, vLLM, torch, numpy or PIL at import."""
    code = (
        "import sys, iris_client; heavy = {'ray', 'vllm', 'torch', 'numpy', 'PIL', 'cache_service', 'pipeline'}; "
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_content_uuid_is_the_servers():
    from cache_service.keys import content_uuid as server_content_uuid

    png = unique_png()
    assert content_uuid(png) == server_content_uuid(png)
