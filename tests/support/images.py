"""Deterministic test images of different sizes and aspect ratios."""

from __future__ import annotations

import base64
import io

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


def png_bytes(name: str) -> bytes:
    buf = io.BytesIO()
    make_image(*SIZES[name]).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()
