"""Iris's Python client: the official `openai` client, plus upload-free images.

`IrisClient(base_url=..., api_key=...).chat.completions.create(...)` takes images as bytes,
paths, PIL images or URLs in `{"type": "image", "image": ..., "uuid": ...}` parts, sends each
image this process has sent before by id only, and resends the bytes of the ones the server
no longer holds (409 mm_cache_miss) once, by itself. docs/client.md has the recipes.

Needs only openai, httpx and blake3 (PIL images are accepted when Pillow is installed).
"""

from iris_client.client import AsyncIrisClient, IrisClient
from iris_client.content import CONTENT_UUID_PREFIX, content_uuid
from iris_client.errors import CacheMissError
from iris_client.report import Report, Totals
from iris_client.sent import SentKeys

__all__ = [
    "AsyncIrisClient",
    "CONTENT_UUID_PREFIX",
    "CacheMissError",
    "IrisClient",
    "Report",
    "SentKeys",
    "Totals",
    "content_uuid",
]
