"""load_media_bytes and decode_image: formats, limits, vLLM's conversions, and http
fetching against a local server on 127.0.0.1 (never any other address)."""

from __future__ import annotations

import base64
import io
import os
import socket
import threading
import time

import pytest
from PIL import Image, ImageFile
from vllm.multimodal.media import ImageMediaIO

from pipeline.errors import IrisError
from pipeline.media.decode import decode_image
from pipeline.media.fetch import fetch_client, load_media_bytes
from pipeline.media.limits import MediaLimits
from tests.support.http_server import QuietHandler, http_server
from tests.support.images import format_corpus

LIMITS = MediaLimits()
VLLM_IO = ImageMediaIO()  # vLLM's image loader with vLLM serve's defaults (RGB, white background)


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def noise(size=(64, 48), mode="RGB") -> Image.Image:
    # Random pixels: compresses badly, so truncation really cuts pixel data.
    w, h = size
    return Image.frombytes(mode, size, os.urandom(w * h * len(mode)))


PNG = encode(noise(), "PNG")


async def expect_error(coro, code: str) -> IrisError:
    with pytest.raises(IrisError) as ei:
        await coro
    assert ei.value.status_code == 400
    assert ei.value.code == code, ei.value.message
    return ei.value


def decode_error(data: bytes, code: str, limits: MediaLimits = LIMITS) -> IrisError:
    with pytest.raises(IrisError) as ei:
        decode_image(data, limits, VLLM_IO)
    assert ei.value.status_code == 400
    assert ei.value.code == code, ei.value.message
    return ei.value


# --------------------------------------------------------------------------- limits model


def test_media_limits_defaults_and_validation():
    assert LIMITS.max_image_bytes == 20 * 1024 * 1024
    assert LIMITS.max_image_pixels == 40_000_000
    assert LIMITS.fetch_timeout_s == 10
    assert LIMITS.allowed_formats == {"JPEG", "PNG", "WEBP", "GIF", "BMP"}
    assert LIMITS.allow_http is True
    assert MediaLimits(allowed_formats={"png", "Tiff"}).allowed_formats == {"PNG", "TIFF"}
    with pytest.raises(ValueError):
        MediaLimits(max_image_bytes=0)
    with pytest.raises(ValueError):
        MediaLimits(allowed_local_paths=["/"])  # file access is never configurable


# --------------------------------------------------------------------------- data: URLs


@pytest.mark.parametrize(
    "fmt,mime,kw",
    [("PNG", "image/png", {}), ("JPEG", "image/jpeg", {"quality": 90}), ("WEBP", "image/webp", {})],
)
async def test_data_url_roundtrip(fmt, mime, kw):
    raw = encode(noise((40, 30)), fmt, **kw)
    data = await load_media_bytes(data_url(raw, mime), LIMITS)
    assert data == raw
    img = decode_image(data, LIMITS, VLLM_IO)
    assert img.mode == "RGB" and img.size == (40, 30)


async def test_data_url_exact_pixels_png():
    src = Image.new("RGB", (3, 2), (10, 200, 30))
    img = decode_image(await load_media_bytes(data_url(encode(src, "PNG")), LIMITS), LIMITS, VLLM_IO)
    assert img.getpixel((2, 1)) == (10, 200, 30)


async def test_data_url_invalid_base64():
    err = await expect_error(load_media_bytes("data:image/png;base64,iVBOR$$w0KGgo=", LIMITS), "invalid_image")
    assert "base64" in err.message


async def test_data_url_base64_bad_padding():
    await expect_error(load_media_bytes("data:image/png;base64,iVBORw0KGg", LIMITS), "invalid_image")


async def test_data_url_whitespace_rejected_strictly():
    b64 = base64.b64encode(PNG).decode()
    await expect_error(load_media_bytes(f"data:image/png;base64,{b64[:20]}\n{b64[20:]}", LIMITS), "invalid_image")


async def test_data_url_not_base64():
    await expect_error(load_media_bytes("data:image/png,rawbytes", LIMITS), "invalid_image_url")


async def test_data_url_no_comma():
    await expect_error(load_media_bytes("data:image/png;base64", LIMITS), "invalid_image_url")


async def test_data_url_wrong_media_type():
    await expect_error(load_media_bytes(data_url(PNG, "text/plain"), LIMITS), "invalid_image_url")


async def test_data_url_empty_payload():
    await expect_error(load_media_bytes("data:image/png;base64,", LIMITS), "invalid_image")


async def test_data_url_too_large_checked_before_decoding():
    limits = MediaLimits(max_image_bytes=1000)
    # Not even valid base64: if it were decoded first we would see invalid_image.
    err = await expect_error(load_media_bytes("data:image/png;base64," + "!!!!" * 1000, limits), "image_too_large")
    assert "1000" in err.message


async def test_data_url_size_boundary():
    limits = MediaLimits(max_image_bytes=1000)
    assert len(await load_media_bytes(data_url(b"x" * 1000), limits)) == 1000
    await expect_error(load_media_bytes(data_url(b"x" * 1001), limits), "image_too_large")


@pytest.mark.parametrize(
    "url",
    ["file:///etc/passwd", "FILE:///etc/hosts", "ftp://127.0.0.1/a.png", "/etc/passwd", "img.png", "c:\\img.png", ""],
)
async def test_other_schemes_rejected(url):
    await expect_error(load_media_bytes(url, LIMITS), "invalid_image_url")


async def test_http_disabled():
    err = await expect_error(
        load_media_bytes("http://127.0.0.1:9/x.png", MediaLimits(allow_http=False)), "invalid_image_url"
    )
    assert "disabled" in err.message


async def test_param_is_carried():
    err = await expect_error(
        load_media_bytes("file:///x", LIMITS, param="messages[0].content[1].image_url.url"), "invalid_image_url"
    )
    assert err.param == "messages[0].content[1].image_url.url"


# --------------------------------------------------------------------------- decoding


def test_non_image_bytes():
    decode_error(b"this is not an image at all, just text" * 10, "invalid_image")


def test_empty_bytes():
    decode_error(b"", "invalid_image")


def test_truncated_png():
    err = decode_error(PNG[: len(PNG) // 2], "invalid_image")
    assert "PNG" in err.message
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False  # we never flip Pillow's global


def test_bytes_over_limit():
    decode_error(PNG, "image_too_large", MediaLimits(max_image_bytes=len(PNG) - 1))


@pytest.fixture
def load_forbidden(monkeypatch):
    # A bomb must be rejected from its header: loading pixels would be the bug.
    def boom(self):
        raise AssertionError("pixels were loaded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", boom)


def test_decompression_bomb_over_our_limit(load_forbidden):
    bomb = encode(Image.new("L", (8000, 8000)), "PNG")  # 64 MP, under Pillow's own guard
    assert len(bomb) < 200_000
    err = decode_error(bomb, "image_too_large")
    assert "8000x8000" in err.message and "40000000" in err.message


def test_decompression_bomb_over_pillow_limit(load_forbidden):
    bomb = encode(Image.new("1", (20000, 20000)), "PNG")  # 400 MP in ~50 KB
    assert len(bomb) < 200_000
    decode_error(bomb, "image_too_large")


def test_pixel_limit_is_configurable():
    img = encode(Image.new("RGB", (100, 100)), "PNG")
    decode_error(img, "image_too_large", MediaLimits(max_image_pixels=9_999))
    assert decode_image(img, MediaLimits(max_image_pixels=10_000), VLLM_IO).size == (100, 100)


@pytest.mark.parametrize("fmt", ["TIFF", "ICO"])
def test_unsupported_format(fmt):
    data = encode(Image.new("RGB", (16, 16), "red"), fmt)
    err = decode_error(data, "unsupported_image_format")
    assert fmt in err.message
    # and it decodes once the format is allowed
    allowed = MediaLimits(allowed_formats=LIMITS.allowed_formats | {fmt})
    assert decode_image(data, allowed, VLLM_IO).size == (16, 16)


def test_bmp_and_gif_allowed_by_default():
    for fmt in ("BMP", "GIF"):
        assert decode_image(encode(Image.new("RGB", (5, 7), "blue"), fmt), LIMITS, VLLM_IO).size == (5, 7)


def test_animated_gif_first_frame():
    frames = [Image.new("RGB", (12, 10), c) for c in ((255, 0, 0), (0, 0, 255))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    img = decode_image(data, LIMITS, VLLM_IO)
    assert img.mode == "RGB" and img.size == (12, 10)
    r, g, b = img.getpixel((5, 5))
    assert r > 200 and b < 50


# --------------------------------------------------------------------------- conversions: vLLM's
# Past the checks, the pixels are vLLM's ImageMediaIO's (as `vllm serve` decodes an upload):
# alpha, palette transparency, 16-bit, CMYK, EXIF orientation, animation are whatever it makes of them.

EXTRA = {  # modes and formats beyond the parity corpus, for the decoder only
    "png-la": encode(noise((30, 20), "LA"), "PNG"),
    "png-palette": encode(noise((30, 20), "L").convert("P"), "PNG"),
    "webp-rgba": encode(noise((30, 20), "RGBA"), "WEBP", lossless=True),
    "png-animated": encode(noise((20, 10)), "PNG", save_all=True, append_images=[noise((20, 10))]),
    "jpeg-mpo": encode(noise((20, 10)), "MPO", save_all=True, append_images=[noise((20, 10))]),
    "bmp": encode(noise((30, 20)), "BMP"),
    "tiff-float": encode(noise((30, 20), "L").convert("F"), "TIFF"),
    "tiff-i16": encode(Image.new("I;16", (30, 20), 40_000), "TIFF"),
}


@pytest.mark.parametrize("name", sorted(format_corpus()) + sorted(EXTRA))
def test_pixels_are_vllm_image_media_io(name):
    data = format_corpus().get(name) or EXTRA[name]
    limits = MediaLimits(allowed_formats=LIMITS.allowed_formats | {"TIFF"})
    img = decode_image(data, limits, VLLM_IO)
    ref = ImageMediaIO().load_bytes(data).media
    assert img.mode == ref.mode == "RGB"
    assert img.size == ref.size and img.tobytes() == ref.tobytes()


def test_16_bit_grayscale_is_what_vllm_makes_of_it():
    # vLLM (Pillow) clips 16-bit samples to 255; Iris once rescaled them, and answered differently.
    data = encode(Image.new("I;16", (4, 4), 32896), "PNG")
    vllm = ImageMediaIO().load_bytes(data).media.getpixel((0, 0))
    assert decode_image(data, LIMITS, VLLM_IO).getpixel((0, 0)) == vllm


def test_media_io_kwargs_image_apply():
    """engine_args.media_io_kwargs["image"] reaches image decoding (as vLLM's --media-io-kwargs)."""
    src = Image.new("RGBA", (4, 3), (255, 0, 0, 255))
    src.putpixel((0, 0), (0, 0, 0, 0))
    data = encode(src, "PNG")
    assert decode_image(data, LIMITS, VLLM_IO).getpixel((0, 0)) == (255, 255, 255)  # vLLM's default: white
    black = ImageMediaIO(image_mode="RGB", rgba_background_color=[0, 0, 0])
    img = decode_image(data, LIMITS, black)
    assert img.getpixel((0, 0)) == (0, 0, 0) and img.getpixel((1, 0)) == (255, 0, 0)


def test_vision_model_decodes_with_its_media_io_kwargs(tiny_checkpoint):
    from pipeline.model.vision_model import VisionModel

    vision = VisionModel(tiny_checkpoint("llava"), media_io_kwargs={"image": {"rgba_background_color": [0, 0, 0]}})
    assert vision.image_io.rgba_background_color == (0, 0, 0) and vision.image_io.image_mode == "RGB"
    src = Image.new("RGBA", (4, 3), (0, 0, 0, 0))
    assert decode_image(encode(src, "PNG"), LIMITS, vision.image_io).getpixel((2, 2)) == (0, 0, 0)
    assert vision.load_image(encode(src, "PNG")).getpixel((2, 2)) == (0, 0, 0)


# --------------------------------------------------------------------------- http(s)


class _Handler(QuietHandler):
    big_sent = {"bytes": 0, "done": threading.Event()}

    def do_GET(self):
        path = self.path
        if path == "/ok.png":
            self._send(200, PNG, [("Content-Type", "image/png")])
        elif path == "/missing.png":
            self._send(404, b"not found")
        elif path == "/error":
            self._send(500, b"oops")
        elif path == "/redirect":
            self._send(302, headers=[("Location", "/ok.png")])
        elif path.startswith("/chain/"):
            n = int(path.rsplit("/", 1)[1])
            self._send(302, headers=[("Location", f"/chain/{n - 1}" if n > 0 else "/ok.png")])
        elif path == "/to-file":
            self._send(302, headers=[("Location", "file:///etc/passwd")])
        elif path == "/empty":
            self._send(200, b"")
        elif path == "/declared-huge":
            # Lies about a huge body; we must refuse from the header alone.
            self.send_response(200)
            self.send_header("Content-Length", str(10**12))
            self.end_headers()
            self.wfile.write(b"x" * 1000)
        elif path == "/endless":
            # No Content-Length: only counting the body can stop this.
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            chunk = b"\0" * 65536
            try:
                for _ in range(1024):  # 64 MiB if nobody hangs up
                    self.wfile.write(chunk)
                    _Handler.big_sent["bytes"] += len(chunk)
            except OSError:
                pass
            finally:
                _Handler.big_sent["done"].set()
                self.close_connection = True
        elif path == "/slow":
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            try:
                for _ in range(20):  # trickles for 4 s at most
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                pass
            self.close_connection = True
        else:
            self._send(404)


@pytest.fixture(scope="module")
def server():
    with http_server(_Handler) as httpd:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"


# The test server is on loopback, which the SSRF guard refuses unless allowed
# (tests/test_fetch_guard.py tests the guard itself).
LOOPBACK = MediaLimits(allowed_fetch_cidrs={"127.0.0.0/8"})


@pytest.fixture
async def client():
    async with fetch_client(LOOPBACK) as c:
        yield c


async def test_http_ok_default_client(server):
    data = await load_media_bytes(f"{server}/ok.png", LOOPBACK)
    assert data == PNG
    assert decode_image(data, LIMITS, VLLM_IO).size == (64, 48)


async def test_http_ok_shared_client(server, client):
    assert await load_media_bytes(f"{server}/ok.png", LOOPBACK, client) == PNG
    assert await load_media_bytes(f"{server}/redirect", LOOPBACK, client) == PNG


async def test_http_404(server, client):
    url = f"{server}/missing.png"
    err = await expect_error(load_media_bytes(url, LOOPBACK, client), "image_fetch_failed")
    # The URL is the client's own (its random port may contain "404"); the rest must not echo the answer.
    answer = err.message.replace(url, "")
    assert "did not return the image" in answer and "404" not in answer


async def test_http_500(server, client):
    url = f"{server}/error"
    err = await expect_error(load_media_bytes(url, LOOPBACK, client), "image_fetch_failed")
    answer = err.message.replace(url, "")
    assert "did not return the image" in answer and "500" not in answer and "oops" not in answer


async def test_http_redirect_limit(server, client):
    limits = MediaLimits(max_redirects=3, allowed_fetch_cidrs={"127.0.0.0/8"})
    assert await load_media_bytes(f"{server}/chain/2", limits, client) == PNG  # 3 redirects
    err = await expect_error(load_media_bytes(f"{server}/chain/3", limits, client), "image_fetch_failed")
    assert "redirects" in err.message


async def test_http_redirect_to_file_rejected(server, client):
    await expect_error(load_media_bytes(f"{server}/to-file", LOOPBACK, client), "image_fetch_failed")


async def test_http_empty_body(server, client):
    await expect_error(load_media_bytes(f"{server}/empty", LOOPBACK, client), "image_fetch_failed")


async def test_http_declared_too_large(server, client):
    await expect_error(load_media_bytes(f"{server}/declared-huge", LOOPBACK, client), "image_too_large")


async def test_http_too_large_stops_early(server, client):
    limits = MediaLimits(max_image_bytes=1024 * 1024, allowed_fetch_cidrs={"127.0.0.0/8"})
    _Handler.big_sent["bytes"] = 0
    _Handler.big_sent["done"].clear()
    await expect_error(load_media_bytes(f"{server}/endless", limits, client), "image_too_large")
    assert _Handler.big_sent["done"].wait(10), "server kept sending after we gave up"
    # Socket buffers absorb a few MiB at most; the full body is 64 MiB.
    assert _Handler.big_sent["bytes"] < 32 * 1024 * 1024


async def test_http_slow_server_times_out(server, client):
    t0 = time.monotonic()
    err = await expect_error(
        load_media_bytes(
            f"{server}/slow", MediaLimits(fetch_timeout_s=0.5, allowed_fetch_cidrs={"127.0.0.0/8"}), client
        ),
        "image_fetch_failed",
    )
    assert time.monotonic() - t0 < 2.0
    assert "timed out" in err.message


async def test_http_connection_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Nothing listens on the port now.
    err = await expect_error(load_media_bytes(f"http://127.0.0.1:{port}/x.png", LOOPBACK), "image_fetch_failed")
    assert "could not connect" in err.message
