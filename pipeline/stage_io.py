"""What the serving stages hand to one another (plain dataclasses, pickled by Ray).

Ingress -> Preprocess: `ImageJob` (bytes of an image whose features are not cached).
Preprocess -> VisionEncoder: the key and the family's `PixelInputs`.
VisionEncoder -> Ingress: `EncodedImage`, i.e. the key and metadata; the tensors
  travel only when they could not be stored cluster-wide (Redis down or value
  too large), so that the request still succeeds.
Ingress -> LLMDecode: `DecodeRequest` with the cache keys of its images.
LLMDecode -> Ingress: `DecodeChunk`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cache_service.codec import Features
from pipeline.chat_request import SamplingOptions


@dataclass
class ImageJob:
    index: int  # position of the image in the request
    key: str
    data: bytes


@dataclass
class EncodedImage:
    index: int
    key: str
    num_tokens: int
    features: Features | None = None  # set only when not retrievable from the cache


@dataclass
class DecodeRequest:
    request_id: str
    messages: list[dict[str, Any]]  # chat-template messages, one {"type": "image"} part per image
    image_keys: list[str]  # one per image part, in prompt order
    sampling: SamplingOptions
    inline_features: dict[str, Features] = field(default_factory=dict)


@dataclass
class DecodeChunk:
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    missing_keys: list[str] | None = None  # features vanished from the cache: ingress re-encodes
    error: dict[str, Any] | None = None  # IrisError fields when the engine rejected the request
