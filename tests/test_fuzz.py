"""Property-based fuzzing (hypothesis) of the pipeline's hostile-input surface.

The property everywhere: the answer is either a correct result or an IrisError
with a 4xx status in OpenAI's error shape; never any other exception (which the
ingress would turn into a 500). No Ray, no network.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import struct
import zlib

import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from PIL import Image
from pydantic import ValidationError
from vllm.exceptions import VLLMError
from vllm.multimodal.media import ImageMediaIO

from pipeline.api.body import parse_json_body
from pipeline.api.media_parts import parse_request, request_models
from pipeline.errors import IrisError
from pipeline.media.decode import decode_image
from pipeline.media.fetch import load_media_bytes
from pipeline.media.limits import MediaLimits

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)  # reproducible in CI; new inputs come from editing strategies
LIMITS = MediaLimits()
VLLM_IO = ImageMediaIO()  # as `vllm serve` decodes images (RGB, white background)
MAX_MESSAGE_CHARS = 2000  # errors must not echo megabytes of client input


def note(outcome: str) -> None:
    """Outcome counts for --hypothesis-show-statistics (no-op outside hypothesis)."""
    try:
        event(outcome[:40])
    except InvalidArgument:
        pass


def check_client_error(err: IrisError) -> None:
    assert 400 <= err.status_code < 500, err
    body = err.to_dict()["error"]
    assert isinstance(body["message"], str) and body["message"]
    assert set(body) >= {"message", "type", "param", "code"}
    assert body["param"] is None or isinstance(body["param"], str)
    assert len(body["message"]) <= MAX_MESSAGE_CHARS, body["message"][:200]
    json.dumps(err.to_dict())  # the ingress must be able to send it


def strings_of(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from strings_of(v)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            yield from strings_of(getattr(value, name))


# --------------------------------------------------------------------------- request schema

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63 - 2, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def maybe(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Valid values, one time in ten anything: enough valid bodies get past the
    schema to reach the checks behind it."""
    return st.integers(0, 9).flatmap(lambda i: json_values if i == 0 else valid)


def rarely(valid: st.SearchStrategy, odd: st.SearchStrategy) -> st.SearchStrategy:
    return st.integers(0, 4).flatmap(lambda i: odd if i == 0 else valid)


urls = rarely(
    st.sampled_from(["data:image/png;base64,iVBORw0KGgo=", "http://example.com/a.png"]),
    st.one_of(st.just(""), st.just("   "), st.text(max_size=30), st.just(None)),
)
uuids = rarely(
    st.one_of(st.none(), st.text(min_size=1, max_size=20)),
    st.one_of(
        st.just(""),
        st.just(" "),
        st.just("u" * 600),
        st.integers(),
        st.booleans(),
        st.lists(st.text(max_size=3), max_size=2),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
        st.just("\ud800"),
        st.just("caf\u00e9"),
    ),
)
texts = rarely(
    st.text(min_size=1, max_size=30),
    st.sampled_from(["", "\ud800 lone surrogate", "a\udfff", "\x00", "\ufeff", "\U0001f600"]),
)

image_part = st.fixed_dictionaries(
    {"type": st.just("image_url")},
    optional={
        "image_url": maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "url": urls,
                    "detail": rarely(st.sampled_from(["auto", "low", "high"]), st.sampled_from(["huge", None])),
                },
            )
        ),
        "uuid": uuids,
    },
)
text_part = st.fixed_dictionaries({"type": st.just("text")}, optional={"text": maybe(texts)})
other_part = st.fixed_dictionaries({"type": maybe(st.sampled_from(["input_audio", "video_url", "file", "", "TEXT"]))})
parts = rarely(st.one_of(image_part, text_part), st.one_of(other_part, json_values))
messages = st.fixed_dictionaries(
    {
        "role": rarely(
            st.sampled_from(["user"] * 6 + ["system", "developer", "assistant"]),
            st.sampled_from(["tool", "User", ""]) | json_values,
        )
    },
    optional={
        "content": maybe(st.one_of(st.lists(parts, min_size=1, max_size=6), texts)),
        "name": maybe(st.text(max_size=5)),
    },
)
bodies = st.fixed_dictionaries(
    {"messages": maybe(st.lists(messages, min_size=1, max_size=5))},
    optional={
        "model": maybe(st.text(max_size=10)),
        "stream": maybe(st.booleans()),
        "stream_options": maybe(st.fixed_dictionaries({}, optional={"include_usage": maybe(st.booleans())})),
        "max_tokens": maybe(st.integers(min_value=1, max_value=2**66)),
        "max_completion_tokens": maybe(st.integers(min_value=-5, max_value=100)),
        "temperature": rarely(st.floats(0, 2), st.floats(allow_nan=True, allow_infinity=True)),
        "top_p": rarely(st.floats(0.01, 1), st.floats(min_value=-1, max_value=2)),
        "seed": maybe(st.integers(min_value=-(2**70), max_value=2**70)),
        "stop": maybe(st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(max_size=5), max_size=6))),
        "n": rarely(st.just(1), st.integers(min_value=-2, max_value=3)),
        "unknown_extra": json_values,
    },
)


# Bodies a well-behaved client could send (so the fuzz also reaches success paths:
# image placement and counting, sampling options), mixed with the hostile ones.
clean_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(min_size=1, max_size=20)}),
    st.fixed_dictionaries(
        {
            "type": st.just("image_url"),
            "image_url": st.one_of(
                st.none(),
                st.fixed_dictionaries(
                    {"url": st.sampled_from(["data:image/png;base64,iVBORw0KGgo=", "https://example.com/a.png"])}
                ),
            ),
        },
        optional={"uuid": st.text(min_size=1, max_size=20).filter(str.strip)},
    ),
)
clean_messages = st.fixed_dictionaries(
    {"role": st.just("user"), "content": st.lists(clean_parts, min_size=1, max_size=6)}
)
clean_bodies = st.fixed_dictionaries(
    {"messages": st.lists(clean_messages, min_size=1, max_size=4)},
    optional={
        "stream": st.booleans(),
        "max_tokens": st.integers(1, 4096),
        "temperature": st.floats(0, 2),
        "seed": st.integers(0, 2**63 - 1),
        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=4),
    },
)
bodies = st.one_of(clean_bodies, bodies)


MODELS = request_models()


def check_parse(body, max_images: int = 4):
    """The ingress's parse: vLLM's request model, then Iris's media items. A refusal is pydantic's
    (vLLM's validation handler formats it) or Iris's 400; what passes must cross to LLMDecode."""
    try:
        request, items = parse_request(MODELS, "chat", body, {"image": max_images, "video": 1})
    except ValidationError:
        note("400 vLLM's validation")
        return None
    except (
        ValueError,
        TypeError,
        VLLMError,
    ):  # vLLM's own validators past pydantic: its 400 as `vllm serve` answers it
        note("400 vLLM's validator")
        return None
    except IrisError as err:
        check_client_error(err)
        note(f"400 {err.code or err.param}")
        return None
    note(f"ok, {len(items)} image(s)")
    assert sum(item.modality == "image" for item in items) <= max_images
    assert [item.index for item in items] == list(range(len(items)))
    pickle.loads(pickle.dumps(request))  # Ray pickles it to the decode replica
    return request


@FUZZ
@given(bodies, st.integers(min_value=0, max_value=4))
def test_fuzz_chat_request_structured(body, max_images):
    check_parse(body, max_images)


@FUZZ
@given(json_values)
def test_fuzz_chat_request_any_json(body):
    check_parse(body)


@FUZZ
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode) | bodies.map(lambda b: json.dumps(b).encode()))
def test_fuzz_body_bytes_to_chat(raw):
    """The ingress's path from raw bytes: parse_json_body then parse_request."""
    try:
        body = parse_json_body(raw)
    except IrisError as err:
        check_client_error(err)
        return
    check_parse(body)


def _user(*content) -> dict:
    return {"role": "user", "content": list(content)}


IMG = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [_user({"type": "text", "text": "x"})] * 20_000},  # many messages
        {"messages": [_user(*([{"type": "text", "text": "x"}] * 50_000))]},  # many parts
        {"messages": [_user(*([IMG] * 10_000))]},  # many images
        {"messages": [_user(*([{"type": "image_url", "image_url": None, "uuid": str(i)} for i in range(5000)]))]},
        {"messages": [{"role": "user", "content": "x" * 5_000_000}]},  # one huge text
        {"messages": [_user({"type": "image_url", "image_url": {"url": "data:," + "A" * 5_000_000}, "uuid": 7})]},
        {"messages": [_user({"type": "image_url", "uuid": {"$ne": None}})]},  # non-string uuids
        {"messages": [_user({"type": "image_url", "uuid": ["a"]})]},
        {"messages": [_user({"type": "image_url", "uuid": 12345678901234567890})]},
        {"messages": [_user({"type": "image_url", "uuid": True})]},
        {"messages": [_user({"type": "image_url", "uuid": "\ud800"})]},  # lone surrogate
        {"messages": [_user({"type": "text", "text": "a\udfffb"})]},
        {"messages": [{"role": "user", "content": "hi"}], "stop": ["\ud800"]},
        {"messages": [{"role": "user", "content": "hi"}], "model": "\udc00"},
        {"messages": [{"role": "user", "content": "hi", "name": "\ud83d"}]},
        {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64},  # huge numbers
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**30},
        {"messages": [{"role": "user", "content": "hi"}], "temperature": float("nan")},
        {"messages": [{"role": "user", "content": "hi"}], "temperature": float("inf")},
        {"messages": {"role": "user", "content": "hi"}},  # wrong types
        {"messages": "hi"},
        {"messages": None},
        {},
        {"messages": [[]]},
        {"messages": [None]},
    ],
)
def test_hostile_chat_bodies(body):
    check_parse(body)


def test_huge_image_count_error_names_first_extra_image_only():
    with pytest.raises(IrisError) as ei:
        parse_request(MODELS, "chat", {"messages": [_user(*([IMG] * 10_000))]}, {"image": 4})
    assert ei.value.code == "too_many_images" and ei.value.param == "messages[0].content[4]"


# --------------------------------------------------------------------------- image bytes


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def gradient(size=(24, 16)) -> Image.Image:
    w, h = size
    return Image.frombytes(
        "RGB", size, bytes((x * 10 + y * 3) % 256 for y in range(h) for x in range(w) for _ in range(3))
    )


SEEDS = {
    "png": encode(gradient(), "PNG"),
    "jpeg": encode(gradient(), "JPEG", quality=90),
    "gif": encode(gradient().convert("P"), "GIF"),
    "webp": encode(gradient(), "WEBP"),
    "bmp": encode(gradient(), "BMP"),
    "tiff": encode(gradient(), "TIFF"),  # a real image, but not an allowed format
}


def check_decode(data: bytes, limits: MediaLimits = LIMITS) -> Image.Image | None:
    try:
        img = decode_image(data, limits, VLLM_IO)
    except IrisError as err:
        check_client_error(err)
        note(f"decode: 400 {err.code}")
        return None
    note("decode: ok")
    assert img.mode == "RGB"
    w, h = img.size
    assert w > 0 and h > 0 and w * h <= limits.max_image_pixels
    img.tobytes()  # really decoded
    return img


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_decode_garbage(data):
    check_decode(data)


@FUZZ
@given(st.sampled_from(sorted(SEEDS)), st.data())
def test_fuzz_decode_mutated_images(name, data):
    """Real images, truncated and with bytes flipped: headers, chunk lengths, pixel data."""
    raw = bytearray(SEEDS[name])
    cut = data.draw(st.integers(min_value=0, max_value=len(raw)), label="cut")
    raw = raw[:cut] if data.draw(st.booleans(), label="truncate") else raw
    for _ in range(data.draw(st.integers(min_value=0, max_value=6), label="flips")):
        if raw:
            pos = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
            raw[pos] = data.draw(st.integers(min_value=0, max_value=255))
    check_decode(bytes(raw))


# Every mode Pillow can write to each allowed format, any EXIF orientation: vLLM's RGB
# image (pixel for pixel) of the right (oriented) size, or a clean 4xx.
MODES = ["1", "L", "LA", "P", "PA", "RGB", "RGBA", "CMYK", "I;16", "I", "F", "YCbCr", "La", "RGBa"]


@FUZZ
@given(
    st.sampled_from(["PNG", "JPEG", "GIF", "WEBP", "BMP"]),
    st.sampled_from(MODES),
    st.integers(min_value=1, max_value=40),
    st.integers(min_value=1, max_value=40),
    st.integers(min_value=1, max_value=8),
    st.booleans(),
)
def test_fuzz_valid_images_every_mode_and_orientation(fmt, mode, w, h, orientation, transparency):
    try:
        img = gradient((w, h)).convert(mode)
    except ValueError:
        assume(False)
    kw = {}
    if fmt in ("JPEG", "WEBP", "PNG"):
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif.tobytes()
    if transparency and mode == "P":
        kw["transparency"] = 0
    try:
        data = encode(img, fmt, **kw)
    except (OSError, ValueError, KeyError, TypeError):
        assume(False)  # Pillow cannot write this mode in this format
    out = check_decode(data)
    assert out is not None, f"a valid {mode} {fmt} was refused"
    assert out.tobytes() == ImageMediaIO().load_bytes(data).media.tobytes(), "not vLLM's pixels"
    stored = Image.open(io.BytesIO(data))
    sw, sh = stored.size
    if fmt in ("JPEG", "WEBP", "PNG") and orientation in (5, 6, 7, 8) and stored.getexif().get(0x0112) == orientation:
        sw, sh = sh, sw  # rotated by 90 degrees
    assert out.size == (sw, sh)


def png_with_header(width: int, height: int, bit_depth=8, color_type=2) -> bytes:
    """A tiny PNG whose valid IHDR claims any size (the pixel data is one empty chunk)."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def gif_with_screen(width: int, height: int) -> bytes:
    data = bytearray(encode(Image.new("P", (1, 1)), "GIF"))
    data[6:10] = struct.pack("<HH", width, height)  # logical screen
    i = data.index(b",")  # image descriptor
    data[i + 5 : i + 9] = struct.pack("<HH", width, height)
    return bytes(data)


def bmp_with_size(width: int, height: int) -> bytes:
    data = bytearray(encode(Image.new("RGB", (1, 1)), "BMP"))
    data[18:26] = struct.pack("<ii", width, height)
    return bytes(data)


def jpeg_with_size(width: int, height: int) -> bytes:
    data = bytearray(encode(Image.new("RGB", (8, 8)), "JPEG"))
    i = data.index(b"\xff\xc0")  # SOF0: length(2) precision(1) height(2) width(2)
    data[i + 5 : i + 9] = struct.pack(">HH", height, width)
    return bytes(data)


@pytest.mark.parametrize(
    "data",
    [
        png_with_header(100_000, 100_000),
        png_with_header(2**31 - 1, 1),
        png_with_header(10_000, 5_000),
        png_with_header(7_000, 5_000),
        png_with_header(0, 0),
        png_with_header(0, 10),
        png_with_header(1, 1, 16, 0),
        gif_with_screen(65_535, 65_535),
        gif_with_screen(0, 0),
        bmp_with_size(100_000, 100_000),
        bmp_with_size(30_000, -30_000),
        bmp_with_size(0, 1),
        bmp_with_size(-1, -1),
        jpeg_with_size(65_500, 65_500),
        jpeg_with_size(0, 0),
    ],
    ids=[
        "png-100k",
        "png-2^31",
        "png-50M",
        "png-35M",
        "png-0x0",
        "png-0x10",
        "png-16bit-1x1",
        "gif-65535",
        "gif-0x0",
        "bmp-100k",
        "bmp-topdown-900M",
        "bmp-0x1",
        "bmp-negative",
        "jpeg-65500",
        "jpeg-0x0",
    ],
)
def test_huge_or_zero_dimensions_in_tiny_files(data):
    assert len(data) < 2000
    check_decode(data)


def _frames(fmt: str, **kw) -> bytes:
    frames = [Image.new("RGB", (20, 10), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    return encode(frames[0], fmt, save_all=True, append_images=frames[1:], **kw)


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_animated_images_give_the_first_frame(fmt):
    out = check_decode(_frames(fmt, duration=100, loop=0))
    assert out is not None and out.size == (20, 10)
    r, g, b = out.getpixel((5, 5))
    assert r > 200 and g < 60 and b < 60


def test_multi_picture_jpeg_from_cameras_is_accepted():
    # Pillow calls a JPEG with a second picture (phones, 3D cameras) "MPO".
    out = check_decode(_frames("MPO"))
    assert out is not None and out.size == (20, 10)


def test_exif_rotation_gives_upright_pixels():
    img = Image.new("RGB", (40, 20), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, 10, 20))  # red stripe on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: display = rotate 90 clockwise
    out = check_decode(encode(img, "JPEG", exif=exif.tobytes(), quality=95))
    assert out.size == (20, 40)
    r, _, b = out.getpixel((10, 3))  # the left stripe is now on top
    assert r > 200 and b < 60


# --------------------------------------------------------------------------- data: URLs


async def check_load(url) -> bytes | None:
    try:
        data = await load_media_bytes(url, LIMITS)
    except IrisError as err:
        check_client_error(err)
        return None
    assert isinstance(data, bytes) and 0 < len(data) <= LIMITS.max_image_bytes
    return data


media_types = st.sampled_from(
    [
        "image/png",
        "image/jpeg",
        "IMAGE/PNG",
        "text/plain",
        "application/json",
        "",
        "image/svg+xml",
        "application/octet-stream",
        "image",
        "image/png;charset=utf-8",
        "text/html;base64",
        " image/png ",
    ]
)


@FUZZ
@given(
    media_types,
    st.sampled_from([";base64", "", ";BASE64", ";base64;x=y", ";charset=utf-8"]),
    st.sampled_from(sorted(SEEDS)) | st.binary(max_size=64),
    st.integers(min_value=0, max_value=3),
)
@example("image/png", ";base64", "png", 0)
async def test_fuzz_data_urls(media_type, options, payload, damage):
    raw = SEEDS[payload] if isinstance(payload, str) else payload
    b64 = base64.b64encode(raw).decode()
    b64 = [b64, b64.rstrip("="), b64 + "\n", b64.replace("A", "-")][damage]
    data = await check_load(f"data:{media_type}{options},{b64}")
    if data is not None:
        check_decode(data)


@FUZZ
@given(st.text(max_size=60))
async def test_fuzz_arbitrary_image_url_strings(url):
    # Only data: URLs (and strings with no scheme) here: nothing may go to the network.
    assume(not url.lower().lstrip().startswith(("http:", "https:")))
    await check_load(url)


@pytest.mark.parametrize(
    "url",
    [
        "data:text/plain;base64," + base64.b64encode(SEEDS["png"]).decode(),  # wrong content type
        "data:image/svg+xml;base64," + base64.b64encode(b"<svg xmlns='http://www.w3.org/2000/svg'/>").decode(),
        "data:image/jpeg;base64," + base64.b64encode(SEEDS["png"]).decode(),  # mislabeled: bytes decide
        "data:image/png;base64,",  # zero-size
        "data:image/png;base64," + "A" * (30 * 1024 * 1024),  # over max_image_bytes
        "data:image/png," + "%89PNG",  # not base64
        "data:;base64," + base64.b64encode(SEEDS["gif"]).decode(),  # no media type
        "data:image/png;base64," + base64.b64encode(SEEDS["png"]).decode() + "\x00",
        "data:image/png;base64,\u00e9\u00e9\u00e9\u00e9",
        "data:image/png;base64,\ud800\ud800\ud800\ud800",
    ],
)
async def test_hostile_data_urls(url):
    data = await check_load(url)
    if data is not None:
        check_decode(data)
