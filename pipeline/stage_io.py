"""What the serving stages hand to one another (plain dataclasses, pickled by Ray).

Ingress -> Preprocess: `MediaJob` (bytes of an image or video whose features are not cached).
Preprocess -> VisionEncoder: the family's `PixelInputs` (or the client error
  preprocessing ended in), passed by the ingress as Preprocess's pending response
  (Serve model composition: the pixels go through the object store, not the ingress).
VisionEncoder -> Ingress and LLMDecode: `EncodedMedia`, i.e. the key, metadata and a
  reference to the features in Ray's object store (not the tensors themselves).
Ingress -> LLMDecode: `DecodeCall`, vLLM's request model with each image and video replaced by
  a part that names its cache key, plus the references of the VisionEncoder calls computing
  features for this request, made before they finish: the decoder waits for those and takes
  the features directly, while the Redis write runs behind the response.
LLMDecode -> Ingress: `DecodeOpened` (status, and the body unless streamed), the SSE text of a
  streamed answer (several events merged per message), then `DecodeDone`.
A request's OpenTelemetry context travels in `trace` (deployments/tracing.py).

Errors: a stage that refuses its input (a bad image) answers with an `IrisError` as a value
(Preprocess, VisionEncoder, `DecodeOpened.error`); what vLLM refuses is its own error body;
an exception crossing a stage means a fault (a bug, a dead replica).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import IrisError


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
class DecodeCall:
    """One request for vLLM's serving layer on an LLMDecode replica."""

    route: str  # "chat" | "completion" | "responses": which of vLLM's serving objects answers it
    body: Any  # vLLM's validated request model; each image and video already a keyed part (keyed_media.py)
    media_keys: list[str] = field(default_factory=list)  # one per image or video, in prompt order
    modalities: list[str] = field(default_factory=list)  # of media_keys
    # key -> ObjectRef of the VisionEncoder call computing it for this request (EncodedMedia or
    # IrisError); other keys are read from the cache.
    delivered: dict[str, Any] = field(default_factory=dict)
    tenant: str = "default"  # salts vLLM's prefix cache (pipeline/tenancy/tenant.py cache_salt)
    headers: dict[str, str] = field(default_factory=dict)  # what vLLM reads of the HTTP request (X-Request-Id)
    trace: dict[str, str] | None = None  # W3C trace context (traceparent) of the request's span; None: tracing off


@dataclass
class DecodeOpened:
    """LLMDecode's first message for a call: the answer's status and, unless it streams, its body
    (vLLM's JSON: the response or its error). A streamed answer follows as SSE text, then `DecodeDone`."""

    status: int = 200
    body: str | None = None  # None: streamed
    missing_keys: list[str] | None = None  # features vanished from the cache: the ingress computes them again
    error: IrisError | None = None  # Iris's own refusal (an encode's error, a rolling update)


@dataclass
class DecodeDone:
    """LLMDecode's last message: what the engine counted for the request (tenant limits, metrics)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
