"""Deterministic test images of different sizes and aspect ratios."""

from __future__ import annotations

import base64
import functools
import io
import struct
import uuid
import zlib

import numpy as np
from PIL import Image

# The user text sent with each image: with the image it spans more than one
# 128-token KV block (vLLM's CPU block size), so prefix-cache hits are visible.
REFERENCE_TEXT = "Describe this picture in detail, please. " * 5

# (width, height, seed): square, wide and tall.
SIZES = {"square": (56, 56, 1), "wide": (120, 64, 2), "tall": (40, 90, 3)}


def make_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@functools.cache  # bytes: nothing can change them
def png_bytes(name: str) -> bytes:
    buf = io.BytesIO()
    make_image(*SIZES[name]).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def unique_png(seed: int | None = None, size: tuple[int, int] = (64, 48)) -> bytes:
    """A noise PNG of `size` (width, height): new bytes each call unless `seed` is given."""
    rng = np.random.default_rng(seed if seed is not None else uuid.uuid4().int % 2**32)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def image_part(url: str | None, uid: str | None = None) -> dict:
    """A chat message's image part: by URL, by uuid (`url` None: upload-free), or both."""
    part = {"type": "image_url", "image_url": {"url": url} if url else None}
    if uid is not None:
        part["uuid"] = uid
    return part


# --------------------------------------------------------------------------- format corpus


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _noise(rng: np.random.Generator, shape: tuple[int, ...], high: int = 256, dtype=np.uint8) -> np.ndarray:
    return rng.integers(0, high, shape, dtype=dtype)


def png_rgb16(pixels: np.ndarray) -> bytes:
    """A 16-bit RGB PNG (bit depth 16, colour type 2) of `pixels` [H, W, 3] uint16, written by
    hand: Pillow has no 16-bit RGB mode to save from (it reads such files as 8-bit RGB)."""
    h, w, _ = pixels.shape
    rows = b"".join(b"\0" + pixels[y].astype(">u2").tobytes() for y in range(h))  # filter 0 per row

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


@functools.cache
def format_corpus() -> dict[str, bytes]:
    """Images in the formats and modes clients send (deterministic noise, 40-120 px), for
    comparing Iris's decoding with vLLM's: 16-bit grey and RGB, alpha, palette transparency,
    CMYK, EXIF orientations, WebP, animated GIF, 8-bit grey, 1-bit."""
    rng = np.random.default_rng(2024)
    rgb = lambda w, h: Image.fromarray(_noise(rng, (h, w, 3)))  # noqa: E731
    # 16-bit grey: values over the whole 16-bit range (a decoder that clips sees near-white,
    # one that rescales sees the noise).
    gray16 = Image.fromarray(_noise(rng, (64, 80), 65536, np.uint16))
    assert gray16.mode == "I;16"
    rgba = np.concatenate([_noise(rng, (56, 72, 3)), _noise(rng, (56, 72, 1)) // 128 * 255], axis=2)
    rgba[::7, :, 3] = 90  # partly transparent rows too
    palette = Image.fromarray(_noise(rng, (60, 60), 16)).convert("L").convert("P")
    palette.putpalette(_noise(rng, (768,)).tolist())
    cases = {
        "png-gray16": _encode(gray16, "PNG"),
        "png-rgb16": png_rgb16(_noise(rng, (48, 64, 3), 65536, np.uint16)),
        "png-rgba": _encode(Image.fromarray(rgba, "RGBA"), "PNG"),
        "png-palette-transparency": _encode(palette, "PNG", transparency=3),
        "jpeg-cmyk": _encode(Image.fromarray(_noise(rng, (50, 70, 4)), "CMYK"), "JPEG", quality=92),
        "webp": _encode(rgb(88, 56), "WEBP", quality=80),
        "gif-animated": _encode(
            rgb(64, 48).convert("P"),
            "GIF",
            save_all=True,
            duration=80,
            loop=0,
            append_images=[rgb(64, 48).convert("P") for _ in range(2)],
        ),
        "png-gray8": _encode(Image.fromarray(_noise(rng, (72, 40))), "PNG"),
        "png-1bit": _encode(Image.fromarray(_noise(rng, (64, 64)) > 127), "PNG"),
    }
    for orientation in (3, 6, 8):  # 180°, 90° clockwise, 90° counter-clockwise (non-square: sizes differ)
        exif = Image.Exif()
        exif[0x0112] = orientation
        cases[f"jpeg-exif-{orientation}"] = _encode(rgb(96, 48), "JPEG", quality=90, exif=exif.tobytes())
    return cases
