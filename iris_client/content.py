"""An image part's bytes, from whatever the caller holds: bytes, a path, a PIL image, a URL.

Content uuids: `blake3:<64 lowercase hex>` of the bytes, the form the Iris server reserves
for naming an image by its content (cache_service/keys.py there): the same hash the server
computes, so it maps to exactly the server's content key for those bytes, in the caller's tenant.
"""

from __future__ import annotations

import base64
import io
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from blake3 import blake3

CONTENT_UUID_PREFIX = "blake3:"

# Magic numbers of the formats servers decode, for the data: URL's media type (the server
# decodes by content; the type must only say image/*).
_MAGIC = [
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF8", "image/gif"),
    (b"BM", "image/bmp"),
    (b"II*\x00", "image/tiff"),
    (b"MM\x00*", "image/tiff"),
]


def content_uuid(data: bytes) -> str:
    """The reserved-form uuid that names `data` by content: blake3:<hex>."""
    return CONTENT_UUID_PREFIX + blake3(data).hexdigest()


def media_type(data: bytes) -> str:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((mime for magic, mime in _MAGIC if data.startswith(magic)), "image/png")


def data_url(data: bytes) -> str:
    return f"data:{media_type(data)};base64,{base64.b64encode(data).decode('ascii')}"


def is_remote_url(value: object) -> bool:
    return isinstance(value, str) and value[:8].lower().startswith(("http://", "https://"))


@dataclass
class Loaded:
    """What an image part stands for: its bytes, or (a URL passed through) the URL alone."""

    data: bytes | None
    url: str | None = None  # http(s) URL the server fetches itself (fetch_urls off)


def load(image: object, fetch_urls: bool, http: httpx.Client | None) -> Loaded:
    """The bytes of `image`: bytes-like, a path, a PIL image, a data: or http(s) URL, or a
    zero-argument callable returning one of those (called only when the bytes are needed)."""
    if callable(image) and not _is_pil(image):
        image = image()
    if isinstance(image, (bytes, bytearray, memoryview)):
        return Loaded(bytes(image))
    if _is_pil(image):
        return Loaded(_pil_png(image))
    if isinstance(image, str) and image[:5].lower() == "data:":
        header, _, payload = image.partition(",")
        if ";base64" not in header.lower():
            raise ValueError("only base64 data: URLs are supported")
        return Loaded(base64.b64decode(payload, validate=True))
    if is_remote_url(image):
        if not fetch_urls:
            return Loaded(None, image)
        response = (http or httpx).get(image, follow_redirects=True, timeout=60)
        response.raise_for_status()
        return Loaded(response.content)
    if isinstance(image, (str, os.PathLike)):
        with open(image, "rb") as f:
            return Loaded(f.read())
    raise TypeError(f"an image must be bytes, a path, a PIL image or a URL, not {type(image).__name__}")


def _is_pil(value: object) -> bool:
    # Duck-typed: Pillow is not a dependency, and is never imported here.
    module = sys.modules.get("PIL.Image")
    return module is not None and isinstance(value, module.Image)


def _pil_png(image) -> bytes:
    """PNG, lossless: the same pixels give the same bytes (and content uuid) with one Pillow."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


Loader = Callable[[], Loaded]
