"""The images and videos of a request validated by vLLM's own request models, one record each.

vLLM's request models keep messages as plain dicts, so each media part can be found where
vLLM accepts one (chat: `image_url` / `video_url` in any turn; Responses: `input_image` in an
input message) and later replaced in place by the part that names its cache key
(pipeline/model/keyed_media.py). A record goes with its item from parse to decode: where it
is, what it is, and, once the ingress knows them, its bytes and its key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cache_service.keys import MAX_UUID_CHARS
from pipeline.errors import bad_request

# Content part type -> (modality, the field its URL is in).
PART_TYPES = {
    "image_url": ("image", "image_url"),
    "video_url": ("video", "video_url"),
    "input_image": ("image", "image_url"),
}


# Per-request settings of the image path, which is the server's (one setting for every stage).
SERVER_MEDIA_SETTINGS = ("mm_processor_kwargs", "media_io_kwargs")


@dataclass
class MediaItem:
    index: int  # position among the request's images and videos
    modality: str
    ordinal: int  # position among the request's items of this modality, as vLLM counts them
    url: str | None  # a data: or http(s) URL; None: sent by uuid only (upload-free)
    uuid: str | None
    part: dict  # the content part in the request; replaced by the keyed part once keyed
    where: str  # e.g. messages[1].content[0]
    data: bytes | None = None  # fetched
    key: str | None = None  # its cache key

    @property
    def name(self) -> str:
        """How errors name it: image[0], video[1], ..."""
        return f"{self.modality}[{self.ordinal}]"


def media_items(body: Any, route: str, limits: dict[str, int]) -> list[MediaItem]:
    """The request's images and videos in prompt order; 400 for a malformed one or one past the
    per-prompt limits (vLLM's --limit-mm-per-prompt), before any media work."""
    items: list[MediaItem] = []
    counts: dict[str, int] = {}
    for where, part in _parts(body, route):
        kind = PART_TYPES.get(part.get("type"))
        if kind is None:
            continue
        modality, field = kind
        url, uuid = _url(part.get(field), where, field), part.get("uuid")
        if uuid is not None:
            uuid = str(uuid)
            if not uuid.strip():
                raise bad_request(f"{where}.uuid must be a non-empty string", param=f"{where}.uuid")
            if len(uuid) > MAX_UUID_CHARS:
                raise bad_request(
                    f"{where}.uuid is {len(uuid)} characters long; at most {MAX_UUID_CHARS} are allowed",
                    param=f"{where}.uuid",
                )
        if url is None and uuid is None:
            what = "an image" if modality == "image" else "a video"
            raise bad_request(
                f"{where} needs {field}.url, or a uuid that refers to {what} sent earlier", param=f"{where}.{field}"
            )
        ordinal = counts.get(modality, 0)
        counts[modality] = ordinal + 1
        if counts[modality] > limits.get(modality, 0):
            limit = limits.get(modality, 0)
            if not limit:
                raise bad_request(
                    f"this server takes no {modality} input (its limit per prompt is 0)",
                    param=where,
                    code=f"too_many_{modality}s",
                )
            raise bad_request(
                f"At most {limit} {modality}(s) may be provided in one request (the server's limit "
                "per prompt, as vLLM's --limit-mm-per-prompt)",
                param=where,
                code=f"too_many_{modality}s",
            )
        items.append(MediaItem(len(items), modality, ordinal, url, uuid, part, where))
    return items


def _url(value: Any, where: str, field: str) -> str | None:
    url = value.get("url") if isinstance(value, dict) else value  # Responses: the URL itself
    if url is not None and not isinstance(url, str):
        raise bad_request(f"{where}.{field} must be a URL string", param=f"{where}.{field}")
    if url is not None and not url.strip():
        raise bad_request(f"{where}.{field}.url must not be empty", param=f"{where}.{field}")
    return url


def _parts(body: Any, route: str):
    """(where, part) for every content part of the request's messages (chat) or input (Responses).
    A content vLLM validates lazily (an iterable) is made a list, so its parts can be replaced."""
    if route == "chat":
        messages, name = body.messages, "messages"
    elif route == "responses" and isinstance(body.input, list):
        messages, name = body.input, "input"
    else:
        return
    for mi, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            try:
                content = message["content"] = list(content)
            except ValueError as err:  # pydantic's ValidationError: a part of no known shape
                raise bad_request(f"{name}[{mi}].content: {err}", param=f"{name}[{mi}].content") from None
        for pi, part in enumerate(content):
            if isinstance(part, dict):
                yield f"{name}[{mi}].content[{pi}]", part


def request_models() -> dict:
    """Route -> vLLM's request model for it, as a pydantic TypeAdapter."""
    from pydantic import TypeAdapter
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

    return {
        "chat": TypeAdapter(ChatCompletionRequest),
        "completion": TypeAdapter(CompletionRequest),
        "responses": TypeAdapter(ResponsesRequest),
        "tokenize": TypeAdapter(TokenizeRequest),
        "detokenize": TypeAdapter(DetokenizeRequest),
    }


def parse_request(models: dict, route: str, body: Any, limits: dict[str, int]) -> tuple[Any, list[MediaItem]]:
    """The body as vLLM's request model (pydantic's ValidationError as vLLM raises it) and its
    images and videos (IrisError 400)."""
    request = models[route].validate_python(body)
    items = media_items(request, route, limits)
    for name in SERVER_MEDIA_SETTINGS:
        if items and getattr(request, name, None):
            raise bad_request(
                f"{name} is not supported per request by this server: its images and videos are "
                f"processed by its own stages, with the server's engine_args.{name}",
                param=name,
                code="unsupported_parameter",
            )
    return request, items
