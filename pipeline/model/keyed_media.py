"""Iris's media connector for vLLM's own OpenAI serving layer: media parts that carry a cache key.

The ingress replaces each image and video of a request with a keyed part
(`keyed_part`): `{"type": "image_embeds", "image_embeds": "iris:<key>", "uuid": <key>}` where vLLM
takes the modality's features as embeddings, else `{"type": "image_url", "image_url": {"url":
"iris:<key>"}, "uuid": <key>}` (the engine needs the item itself; Iris's EC connector brings its
features). vLLM's chat parser hands the payload to the media connector named by
`VLLM_MEDIA_CONNECTOR`; this one resolves it to what LLMDecode put in `request_media` for the
request being served: the features' tensors, or the decoded item. The part's `uuid` becomes vLLM's
`multi_modal_uuids` entry, so its prefix and encoder caches know the item by its Iris key.

The lookup is per request (a context variable set around the serving call), so one request can
never name another's items; a payload that is not one of them is refused, and vLLM never fetches
media itself (the ingress does, behind its SSRF guard).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector

CONNECTOR_NAME = "iris"  # VLLM_MEDIA_CONNECTOR on the decode replicas
SCHEME = "iris:"
# The vLLM content part that carries an item of each modality, by how its features reach vLLM.
EMBEDS_PART = {"image": "image_embeds", "video": "video_embeds"}
SOURCE_PART = {"image": "image_url", "video": "video_url"}

_items: ContextVar[dict[str, Any] | None] = ContextVar("iris_request_media", default=None)


def keyed_part(modality: str, key: str, as_embeddings: bool) -> dict:
    """The content part that stands for one item in the request LLMDecode's vLLM serves."""
    payload = SCHEME + key
    if as_embeddings:
        return {"type": EMBEDS_PART[modality], EMBEDS_PART[modality]: payload, "uuid": key}
    return {"type": SOURCE_PART[modality], SOURCE_PART[modality]: {"url": payload}, "uuid": key}


@contextlib.contextmanager
def request_media(items: dict[str, Any]) -> Iterator[None]:
    """While serving one request: key -> its embedding input (a tensor, or a dict of tensors) or its
    decoded item (an image, a video's frames and metadata)."""
    token = _items.set(items)
    try:
        yield
    finally:
        _items.reset(token)


def _resolve(payload: str, what: str) -> Any:
    items = _items.get()
    if isinstance(payload, str) and payload.startswith(SCHEME) and items is not None:
        item = items.get(payload[len(SCHEME) :])
        if item is not None:
            return item
    # Only the ingress writes these parts; anything else came from a client.
    raise VLLMValidationError(
        f"{what} parts are not accepted by this server: send images as image_url "
        "(a data: or http(s) URL) with an optional uuid",
        parameter=what,
    )


@MEDIA_CONNECTOR_REGISTRY.register(CONNECTOR_NAME)
class KeyedMediaConnector(MediaConnector):
    """vLLM's MediaConnector, with every fetch answered from the request's own items."""

    def fetch_image(self, image_url: str, *, image_mode: str | None = "RGB"):
        return _resolve(image_url, "image_url")

    async def fetch_image_async(self, image_url: str, *, image_mode: str | None = "RGB"):
        return _resolve(image_url, "image_url")

    def fetch_video(self, video_url: str, **kwargs):
        return _resolve(video_url, "video_url")

    async def fetch_video_async(self, video_url: str, **kwargs):
        return _resolve(video_url, "video_url")

    def fetch_image_embedding(self, data: str):
        return _resolve(data, "image_embeds")

    async def fetch_image_embedding_async(self, data: str):
        return _resolve(data, "image_embeds")

    def fetch_video_embedding(self, data: str):
        return _resolve(data, "video_embeds")

    async def fetch_video_embedding_async(self, data: str):
        return _resolve(data, "video_embeds")

    def fetch_audio(self, audio_url: str):
        return _resolve(audio_url, "audio_url")

    async def fetch_audio_async(self, audio_url: str):
        return _resolve(audio_url, "audio_url")

    def fetch_audio_embedding(self, data: str):
        return _resolve(data, "audio_embeds")

    async def fetch_audio_embedding_async(self, data: str):
        return _resolve(data, "audio_embeds")
