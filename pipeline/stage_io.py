"""What the serving stages hand to one another (plain dataclasses, pickled by Ray).

Ingress -> Preprocess: `MediaJob` (bytes of an image or video whose features are not cached).
Preprocess -> VisionEncoder: the family's `PixelInputs` (or the client error
  preprocessing ended in), passed by the ingress as Preprocess's pending response
  (Serve model composition: the pixels go through the object store, not the ingress).
VisionEncoder -> Ingress and LLMDecode: `EncodedMedia`, i.e. the key, metadata and a
  reference to the features in Ray's object store (not the tensors themselves).
Ingress -> LLMDecode: `DecodeRequest` with the cache keys of its images and videos, plus the
  references of the VisionEncoder calls computing features for this request, made
  before they finish: the decoder waits for those and takes the features directly,
  while the Redis write runs behind the response.
LLMDecode -> Ingress: `DecodeChunk`s (several token deltas merged per chunk).
A request's OpenTelemetry context travels in `trace` (deployments/tracing.py).

Errors: a stage that refuses its input (a bad image, a prompt too long) answers with
an `IrisError` as a value (Preprocess, VisionEncoder) or in `DecodeChunk.error`;
an exception crossing a stage means a fault (a bug, a dead replica).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.api.errors import IrisError


@dataclass
class MediaJob:
    name: str  # how errors name it: "image[0]", "video[0]", ...
    key: str
    data: bytes
    modality: str = "image"
    tenant: str = "default"  # whose turn it is in the stages' fair sharing (pipeline/tenancy/fair_gate.py)
    keep_source: bool = False  # the features carry `data` (the decoder's engine needs the item: EC connector)
    trace: dict[str, str] | None = None  # W3C trace context (traceparent) of the request's span; None: tracing off


@dataclass
class EncodedMedia:
    key: str
    num_tokens: int
    features_ref: Any  # a Ray ObjectRef of the `Features` (pipeline/ itself knows nothing of Ray)


@dataclass
class DecodeRequest:
    request_id: str
    messages: list[dict[str, Any]] | None  # chat-template messages, one {"type": "image"|"video"} part per item
    media_keys: list[str]  # one per image or video part, in prompt order
    sampling: Any  # vLLM's validated Chat/CompletionRequest: LLMDecode calls its to_sampling_params
    # key -> ObjectRef of the VisionEncoder call computing it for this request (EncodedMedia or
    # IrisError); other keys are read from the cache.
    delivered: dict[str, Any] = field(default_factory=dict)
    tenant: str = "default"  # salts vLLM's prefix cache (pipeline/tenancy/tenant.py cache_salt)
    prompt: str | None = None  # /v1/completions: a text prompt instead of messages
    modalities: list[str] = field(default_factory=list)  # of media_keys; empty: all images
    trace: dict[str, str] | None = None  # W3C trace context (traceparent) of the request's span; None: tracing off


@dataclass
class DecodeChunk:
    """One choice's delta (several engine deltas merged); n > 1 gives one chunk per choice."""
    text: str = ""
    finish_reason: str | None = None
    index: int = 0  # the choice
    stop_reason: int | str | None = None
    # This delta's logprobs: chat entries (a list), or completions' {tokens, token_logprobs, ...} (a dict).
    logprobs: list[dict] | dict | None = None
    done: bool = False  # the request's last chunk: carries the token counts
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    system_fingerprint: str | None = None  # vLLM's fingerprint of the engine's config, on a choice's last chunk
    missing_keys: list[str] | None = None  # features vanished from the cache: ingress re-encodes
    error: IrisError | None = None  # the engine refused the request
