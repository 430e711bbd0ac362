"""Request body parsing: hostile JSON is a 400 invalid_json in OpenAI's shape, never a crash."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.api.body import MAX_DEPTH, WALK_BUDGET, TextMeter, parse_json_body, read_body
from pipeline.errors import IrisError


def invalid(raw: bytes) -> IrisError:
    with pytest.raises(IrisError) as ei:
        parse_json_body(raw)
    err = ei.value
    assert err.status_code == 400 and err.code == "invalid_json", err
    assert err.to_dict() == {
        "error": {"message": err.message, "type": "invalid_request_error", "param": None, "code": "invalid_json"}
    }
    return err


def nested(depth: int, kind: str = "list") -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


@pytest.mark.parametrize("kind", ["list", "object"])
@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 900, 20_000, 1_000_000])
def test_deep_nesting_is_a_400(kind, depth):
    # 20,000 levels used to be a RecursionError inside json.loads -> 500.
    err = invalid(nested(depth, kind))
    assert "nested deeper" in err.message


def test_unclosed_deep_nesting_is_a_400():
    invalid(b"[" * 100_000)
    invalid(b'{"a":' * 100_000)


def test_nesting_up_to_the_limit_is_accepted():
    body = b'{"a":' + nested(MAX_DEPTH - 1) + b"}"
    assert parse_json_body(body)["a"] == json.loads(nested(MAX_DEPTH - 1))
    obj = nested(MAX_DEPTH, "object")
    assert parse_json_body(obj)["a"]["a"]


def test_many_brackets_but_shallow_is_accepted():
    # Over MAX_DEPTH brackets in total (and brackets inside strings) trigger the depth
    # walk, which must count real nesting only.
    body = (
        b'{"m":['
        + b",".join([b'{"t":[[]]}'] * 200_000)
        + b'],"s":"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}'
    )
    assert len(parse_json_body(body)["m"]) == 200_000


def test_deep_nesting_past_the_walk_budget_is_a_400():
    # The walk hands over to the bracket count after WALK_BUDGET elements; deep nesting behind
    # that many elements is still found, and many elements with few brackets are still accepted.
    flat = b",".join([b"0"] * (WALK_BUDGET * 3))
    assert "nested deeper" in invalid(b'{"m":[' + flat + b'],"d":' + nested(MAX_DEPTH + 1) + b"}").message
    assert len(parse_json_body(b'{"m":[' + flat + b'],"d":' + nested(MAX_DEPTH - 2) + b"}")["m"]) == WALK_BUDGET * 3


def test_typical_chat_body():
    body = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "[[{{ not nesting, just text }}]]" * 50},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}, "uuid": "x"},
                ],
            }
        ],
    }
    assert parse_json_body(json.dumps(body).encode()) == body


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": "\xe9"}',  # Latin-1
        b"\xff\xfe{\x00}\x00",  # UTF-16 with BOM: json.loads(bytes) would accept it
        '{"a": 1}'.encode("utf-32"),
        b'{"a": "\xed\xa0\x80"}',  # UTF-8-encoded surrogate (invalid UTF-8)
        b'{"a": "\xc0\xaf"}',  # overlong encoding
        b"\x80\x81\x82",
    ],
)
def test_non_utf8_body_is_a_400(raw):
    assert "UTF-8" in invalid(raw).message


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b" ",
        b"{",
        b'{"a":}',
        b"{'a': 1}",
        b'{"a": 1,}',
        b"NaN x",
        b'{"a": 1} trailing',
        b"\x00",
        '{"a": 1}'.encode("utf-16-le"),  # valid UTF-8 (NULs), not JSON
        b'\xef\xbb\xbf{"a": 1}',  # UTF-8 BOM: not valid JSON text per RFC 8259 on the wire
    ],
)
def test_syntax_errors_are_a_400(raw):
    invalid(raw)


@pytest.mark.parametrize("raw", [b"[]", b"1", b'"s"', b"null", b"true", b"[{}]"])
def test_non_object_is_a_400(raw):
    assert "JSON object" in invalid(raw).message


def test_error_does_not_echo_the_body():
    secret = b'{"messages": "SECRET' + b"x" * 1000
    assert "SECRET" not in invalid(secret).message


# msgspec parses first; what it refuses takes json.loads's path. Either way the values are json.loads's.
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**80), 2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=6), st.booleans())
def test_values_equal_the_standard_librarys(body, ascii_only):
    raw = json.dumps(body, ensure_ascii=ascii_only).encode()
    assert parse_json_body(raw) == json.loads(raw) == body


@pytest.mark.parametrize(
    "raw, key, check",
    [
        (b'{"t": NaN, "u": -Infinity}', "t", math.isnan),  # json.loads's extensions, as before
        (b'{"t": 1e400}', "t", lambda v: v == math.inf),
        (b'{"t": "\\ud800"}', "t", lambda v: v == "\ud800"),  # an escaped lone surrogate
        (b'{"t": 1, "t": 2}', "t", lambda v: v == 2),  # the last duplicate wins in both
    ],
)
def test_what_msgspec_refuses_parses_as_json_loads_does(raw, key, check):
    assert check(parse_json_body(raw)[key])


def text_of(raw: bytes, at_most: int = 4, piece: int | None = None) -> int:
    """TextMeter's count, the body fed in pieces of `piece` bytes (all at once by default)."""
    meter, seen = TextMeter(at_most), []
    for i in range(0, len(raw), piece or len(raw)):
        seen.append(meter.text_bytes(raw[: i + (piece or len(raw))]))
    assert seen == sorted(seen)  # it only grows as bytes arrive
    return meter.text_bytes(raw, final=True)


@pytest.mark.parametrize("piece", [None, 1, 5, 7, 1000])
def test_text_meter_counts_all_but_the_bodys_base64_media_strings(piece):
    """What request_parsing bounds by max_model_len: the body less its first `at_most` JSON strings
    that start with `data:`, quotes included; an escaped `\\/` in the base64 counts as its two bytes."""
    url = "data:image/png;base64," + "QUJD" * 1000
    body = json.dumps(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "hi data: no"},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                }
            ]
        }
    ).encode()
    assert text_of(body, 4, piece) == len(body) - 2 * (len(url) + 2)
    assert text_of(body, 1, piece) == len(body) - (len(url) + 2)  # no more than a request may hold items
    text = b'{"messages": "' + b"x" * 10_000 + b'"}'
    assert text_of(text, 4, piece) == len(text)
    escaped = b'{"a": "data:AB\\/CD"}'
    assert text_of(escaped, 4, piece) == len(escaped) - len(b'"data:AB\\/CD"')
    assert text_of(b'{"a": "data:unterminated', 4, piece) == len(b'{"a": ')


def test_a_text_over_the_bound_is_dropped_as_it_arrives():
    async def pieces(raw: bytes, seen: list):
        for i in range(0, len(raw), 1000):
            seen.append(i)
            yield raw[i : i + 1000]

    async def read(raw: bytes, max_text: int | None, max_bytes: int = 10**7):
        seen: list = []
        return await read_body(pieces(raw, seen), None, max_bytes, max_text, media_strings=2), len(seen)

    text = b'{"prompt": "' + b"x" * 100_000 + b'"}'
    assert asyncio.run(read(text, None)) == (text, 101)
    assert asyncio.run(read(text, len(text))) == (text, 101)
    assert asyncio.run(read(text, len(text) - 1)) == (None, 101)  # read to its end, kept no further
    image = b'{"a": "data:' + b"Q" * 200_000 + b'", "prompt": "hi"}'
    assert asyncio.run(read(image, 100))[0] == image
    with pytest.raises(IrisError) as err:  # past the body's own bound: 413 at once
        asyncio.run(read(text, 1000, max_bytes=50_000))
    assert err.value.status_code == 413
