"""RequestParser's text bound (deployments/request_parsing.py), without Ray: a text over
max_model_len's worth is refused before the JSON parser runs; base64 media are not text; a text
that only looks like a data: URL is. tests/test_text_limits.py checks the same through the app."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from starlette.requests import Request

from deployments import request_parsing
from deployments.config import IrisConfig
from deployments.request_parsing import TEXT_SLACK_BYTES, RequestParser
from pipeline.errors import IrisError

MODEL_LEN = 1000
CAP = MODEL_LEN * IrisConfig().max_text_bytes_per_token + TEXT_SLACK_BYTES


class Decode:
    """What RequestParser asks of LLMDecode's handle: `limits.remote()`, awaited."""

    def __init__(self, model_len: int | None):
        self.model_len, self.asked = model_len, 0
        self.limits = self

    async def _limits(self) -> dict:
        self.asked += 1
        if self.model_len is None:
            raise RuntimeError("no LLMDecode replica")
        return {"max_model_len": self.model_len}

    def remote(self):
        return self._limits()


def request(raw: bytes, piece: int = 65536) -> Request:
    pieces = [raw[i : i + piece] for i in range(0, len(raw), piece)] or [b""]

    async def receive():
        chunk = pieces.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pieces)}

    return Request({"type": "http", "method": "POST", "path": "/", "query_string": b"", "headers": []}, receive)


def parse(parser: RequestParser, route: str, body: dict | bytes):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return asyncio.run(parser.parse(route, request(raw)))


def chat(text: str, *parts: dict) -> dict:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], "max_tokens": 2}


def sized_chat(size: int) -> bytes:
    raw = json.dumps(chat("")).encode()
    raw = json.dumps(chat("x" * (size - len(raw)))).encode()
    assert len(raw) == size
    return raw


def refused(parser: RequestParser, route: str, body, param: str) -> IrisError:
    with pytest.raises(IrisError) as err:
        parse(parser, route, body)
    assert err.value.status_code == 400 and err.value.code == "context_length_exceeded", err.value
    assert err.value.param == param and f"{MODEL_LEN} tokens" in err.value.message
    return err.value


@pytest.fixture
def parser() -> RequestParser:
    return RequestParser(IrisConfig(), Decode(MODEL_LEN))


def test_a_text_over_the_bound_is_refused_before_parsing(parser, monkeypatch):
    def no_parsing(raw):
        raise AssertionError("parsed")

    monkeypatch.setattr(request_parsing, "parse_body", no_parsing)
    refused(parser, "chat", sized_chat(CAP + 1), "messages")
    refused(parser, "chat", sized_chat(20_000_000), "messages")
    refused(parser, "completion", {"prompt": "x" * CAP}, "prompt")
    refused(parser, "responses", {"input": "x" * CAP}, "input")
    assert parser.decode.asked == 1  # max_model_len is asked once


def test_a_text_at_the_bound_is_parsed(parser):
    body, items = parse(parser, "chat", sized_chat(CAP))
    assert not items and len(body.messages[0]["content"][0]["text"]) > CAP - 100


def test_base64_media_are_not_text_but_text_that_looks_like_them_is(parser):
    image = "data:image/png;base64," + base64.b64encode(b"\0" * (3 * CAP)).decode()  # not checked here
    part = {"type": "image_url", "image_url": {"url": image}}
    body, items = parse(parser, "chat", chat("hi", part, part))
    assert [i.url for i in items] == [image, image]
    # Also as JSON writers that escape every '/' send it.
    escaped = json.dumps(chat("hi", part)).replace("/", "\\/").encode()
    assert len(parse(parser, "chat", escaped)[1]) == 1
    # A text part that starts with data: is found only by parsing: refused after it.
    refused(parser, "chat", chat("data:" + "x" * CAP), "messages")
    refused(
        parser, "chat", chat("x" * (CAP // 2), part, {"type": "text", "text": "data:" + "x" * (CAP // 2)}), "messages"
    )


def test_without_a_decode_replica_the_configs_max_model_len_bounds_the_text():
    parser = RequestParser(IrisConfig(engine_args={"max_model_len": MODEL_LEN}), Decode(None))
    refused(parser, "chat", sized_chat(CAP + 1), "messages")
    assert parser.decode.asked == 1 and parser.max_model_len is None  # asked again next time
    parse(parser, "chat", sized_chat(CAP))
    assert parser.decode.asked == 2
