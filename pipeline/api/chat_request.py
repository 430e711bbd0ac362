"""Parse an OpenAI `POST /v1/chat/completions` body into plain dataclasses.

Two steps: pydantic models check the shape and types of the subset of the
OpenAI request we serve (unknown fields are ignored, since OpenAI clients send
extras), then `parse_chat_request` checks the meaning (roles, parts, per-prompt
limits) and flattens images and videos (`image_url` and `video_url` parts, as
`vllm serve` takes them) into one list in order of appearance, leaving a
`MediaPlaceholder(index, modality)` where each sits in its message.

Decision: images and videos are accepted in user messages only. Chat templates
of the VLMs we serve place their tokens where the user turn puts them; one in a
system or assistant turn is either dropped silently or breaks the template, so
we reject it with a clear 400 instead.

Every error is an IrisError 400 whose `param` names the offending field, e.g.
`messages[1].content[0].image_url`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    ValidationError,
    field_validator,
)

from cache_service.keys import MAX_UUID_CHARS
from pipeline.api.errors import bad_request, validation_error
from pipeline.api.sampling import validate_sampling

# ---------------------------------------------------------------------------
# Request body (shape and types only)
# ---------------------------------------------------------------------------


_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_lone_surrogates(v: str) -> str:
    # JSON may carry "\ud800" escapes that decode to a lone surrogate: not
    # Unicode text, and the tokenizer raises TypeError on it (a 500 later on).
    # isascii() is O(1) on CPython's compact strings (the common case: a data URL); else a
    # regex scan, not v.encode(), to avoid copying megabytes of text.
    if v.isascii():
        return v
    m = _SURROGATE.search(v)
    if m:
        raise ValueError(f"must be valid Unicode text (lone surrogate \\u{ord(m.group()):04x} "
                         f"at position {m.start()})")
    return v


# Every string we pass on (text, uuid, url, stop, model, name) is checked.
Text = Annotated[str, AfterValidator(_no_lone_surrogates)]


class _Model(BaseModel):
    # strict: a known field with the wrong JSON type ("5" for max_tokens,
    # "true" for stream) is a 400, not silently coerced.
    model_config = ConfigDict(strict=True, extra="ignore")


class MediaURLModel(_Model):
    # url may be absent/null when the part carries a uuid (upload-free).
    url: Text | None = None
    detail: Literal["auto", "low", "high"] | None = None


class ContentPartModel(_Model):
    # One model for every part type, so an unknown type gets our own message
    # (see _parse_part) instead of a pydantic union error.
    type: Text
    text: Text | None = None
    image_url: MediaURLModel | None = None
    video_url: MediaURLModel | None = None
    uuid: Text | None = None


class MessageModel(_Model):
    # "developer" is OpenAI's newer name for "system"; we treat it as system.
    role: Literal["system", "developer", "user", "assistant"]
    content: list[ContentPartModel] | None = None
    name: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _string_to_text_part(cls, v: Any) -> Any:
        # A plain string is a single text part; keeping one form downstream
        # also keeps error locations free of pydantic's union branch names.
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        if v is not None and not isinstance(v, list):
            raise ValueError("must be a string or a list of content parts")
        return v


class StreamOptionsModel(_Model):
    include_usage: bool | None = None


class ChatBody(_Model):
    # Messages and streaming only: sampling fields are validated by vLLM's own
    # request model (pipeline/api/sampling.py), so they mean what vLLM means.
    model: Text | None = None
    messages: list[MessageModel]
    stream: bool | None = None
    stream_options: StreamOptionsModel | None = None


# ---------------------------------------------------------------------------
# Parsed result (plain dataclasses, what the rest of the pipeline uses)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class MediaPlaceholder:
    index: int  # into ParsedChat.media
    modality: str = "image"


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    parts: list[TextPart | MediaPlaceholder]


@dataclass(frozen=True)
class MediaInput:
    index: int  # position among the request's images and videos
    url: str | None  # data: or http(s) URL; None = upload-free (uuid only)
    uuid: str | None
    modality: str = "image"  # "image" | "video"
    ordinal: int = 0  # position among the request's items of this modality, as vLLM counts them

    @property
    def name(self) -> str:
        """How errors name it: image[0], video[1], ..."""
        return f"{self.modality}[{self.ordinal}]"


# What a content part's type carries, and the URL field it is in.
PART_MODALITIES = {"image_url": "image", "video_url": "video"}


@dataclass(frozen=True)
class ParsedChat:
    messages: list[ChatMessage]
    media: list[MediaInput]
    sampling: Any  # vLLM's validated ChatCompletionRequest (messages stubbed); LLMDecode makes SamplingParams
    stream: bool
    include_usage: bool
    model: str | None


# ---------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------


def parse_chat_request(body: dict, max_images: int, max_videos: int = 0) -> ParsedChat:
    """Validate a chat completions body; raise IrisError 400 on any problem."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        req = ChatBody.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None

    if not req.messages:
        raise bad_request("messages must contain at least one message", param="messages")
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise bad_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )

    messages, media = parse_messages(req.messages, {"image": max_images, "video": max_videos})
    sampling = validate_sampling(body, "chat")
    include_usage = stream and bool(req.stream_options and req.stream_options.include_usage)
    return ParsedChat(
        messages=messages,
        media=media,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        model=req.model,
    )


def parse_messages(raw: list[MessageModel], limits: dict[str, int]) -> tuple[list[ChatMessage], list[MediaInput]]:
    """The messages, with each image or video replaced by a placeholder, and the items in order.
    `limits`: most items per modality (vLLM's --limit-mm-per-prompt)."""
    messages: list[ChatMessage] = []
    media: list[MediaInput] = []
    counts = dict.fromkeys(PART_MODALITIES.values(), 0)
    first_over_limit: dict[str, str] = {}  # modality -> param of its first item past the limit
    for mi, msg in enumerate(raw):
        where = f"messages[{mi}]"
        role = "system" if msg.role == "developer" else msg.role
        if not msg.content or (len(msg.content) == 1 and msg.content[0].text == ""):
            if role != "assistant" or msg.content is None:
                raise bad_request(f"{where}.content must not be empty", param=f"{where}.content")
            # A model's reply can be empty (it stopped at once): a client that sends the
            # conversation back must not be refused for it (vLLM and OpenAI accept it). A
            # missing content stays an error, as in OpenAI's API without tool calls.
            messages.append(ChatMessage(role=role, parts=[TextPart(text="")]))
            continue
        parts: list[TextPart | MediaPlaceholder] = []
        for pi, part in enumerate(msg.content):
            p = f"{where}.content[{pi}]"
            parsed = _parse_part(part, p, role)
            if isinstance(parsed, MediaInput):
                modality = parsed.modality
                if counts[modality] == limits.get(modality, 0):
                    first_over_limit.setdefault(modality, p)
                parsed = MediaInput(len(media), parsed.url, parsed.uuid, modality, counts[modality])
                counts[modality] += 1
                media.append(parsed)
                parts.append(MediaPlaceholder(parsed.index, modality))
            else:
                parts.append(parsed)
        messages.append(ChatMessage(role=role, parts=parts))

    for modality, param in first_over_limit.items():
        limit = limits.get(modality, 0)
        if not limit:
            raise bad_request(f"this server takes no {modality} input (its limit per prompt is 0)",
                              param=param, code=f"too_many_{modality}s")
        raise bad_request(
            f"At most {limit} {modality}(s) may be provided in one request, "
            f"but this request has {counts[modality]} (the server's limit per prompt, "
            f"as vLLM's --limit-mm-per-prompt)",
            param=param,
            code=f"too_many_{modality}s",
        )
    return messages, media


def _parse_part(part: ContentPartModel, p: str, role: str) -> TextPart | MediaInput:
    if part.type == "text":
        if part.text is None:
            raise bad_request(f"{p} has type 'text' but no 'text' string", param=f"{p}.text")
        return TextPart(part.text)
    modality = PART_MODALITIES.get(part.type)
    if modality is None:
        raise bad_request(
            f"unsupported content part type {part.type!r}: only 'text', 'image_url' and 'video_url' are supported",
            param=f"{p}.type",
        )
    if role != "user":
        raise bad_request(
            f"{modality}s are only allowed in user messages, but {p} is in a {role!r} message",
            param=p,
        )
    url_field = getattr(part, part.type)
    url = url_field.url if url_field is not None else None
    if url is not None and url.strip() == "":
        raise bad_request(f"{p}.{part.type}.url must not be empty", param=f"{p}.{part.type}.url")
    uuid = part.uuid
    if uuid is not None:
        if uuid.strip() == "":
            raise bad_request(f"{p}.uuid must be a non-empty string", param=f"{p}.uuid")
        if len(uuid) > MAX_UUID_CHARS:
            raise bad_request(
                f"{p}.uuid is {len(uuid)} characters long; at most {MAX_UUID_CHARS} are allowed",
                param=f"{p}.uuid",
            )
    if url is None and uuid is None:
        raise bad_request(
            f"{p} needs {part.type}.url, or a uuid that refers to {'an image' if modality == 'image' else 'a video'} "
            "sent earlier",
            param=f"{p}.{part.type}",
        )
    return MediaInput(index=-1, url=url, uuid=uuid, modality=modality)  # index assigned by the caller
