"""Deterministic test images of different sizes and aspect ratios."""

from __future__ import annotations

import base64
import functools
import io
import uuid

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
