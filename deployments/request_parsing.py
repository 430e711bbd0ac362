"""An HTTP request's body as vLLM's request model, with its images and videos (one MediaItem
each), or the refusal `vllm serve` would answer with, in its shape (VLLMAnswer).

Iris's own refusals stay IrisErrors: a body too large (413) or not JSON, a malformed media part,
and a text longer than any prompt of the model can be (400 `context_length_exceeded`): its bytes
besides the body's base64 images and videos over max_model_len x `max_text_bytes_per_token`
(+ TEXT_SLACK_BYTES). That one is checked as the raw bytes arrive, before the body is parsed, so a
huge text costs the replicas no parsing, no copy through Ray and no chat template (issue 42). vLLM
0.32 refuses such a text too, by its length in characters before tokenizing, but only after all
of those: 2.2 s for 150 MB on the test machine, against 0.9 s here. Checked again on the parsed
body, where its media parts are known."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from ray.serve.handle import DeploymentHandle

from deployments.config import IrisConfig
from pipeline.api.body import parse_body, read_body
from pipeline.api.media_parts import MediaItem, parse_request, request_models
from pipeline.api.sampling import check_max_tokens
from pipeline.errors import IrisError

logger = logging.getLogger("ray.serve")


# What vLLM reads of an HTTP request's headers (its request id; the trace context travels apart).
FORWARDED_HEADERS = ("x-request-id",)
ANSWER_ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-"}  # vLLM's, before the request id
# The body's JSON around its text (field names, sampling parameters), beyond max_model_len's share.
TEXT_SLACK_BYTES = 64 * 1024
# Where each route's text is, for the refusal's `param`.
TEXT_PARAM = {"chat": "messages", "completion": "prompt", "responses": "input", "tokenize": "prompt"}


def forwarded_headers(request: Request, body: Any) -> dict[str, str]:
    """The headers vLLM gets with the request. Serve's proxy gives every request an X-Request-Id,
    which vLLM would prefer to a `request_id` the body names: the body's wins, as behind `vllm serve`."""
    forwarded = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
    if "request_id" in getattr(body, "model_fields_set", ()):
        forwarded.pop("x-request-id", None)
    return forwarded


def answer_id(route: str, body: Any, forwarded: dict[str, str]) -> str:
    """The id vLLM gives the answer: its prefix, then X-Request-Id, else the body's request_id."""
    return ANSWER_ID_PREFIX.get(route, "") + (forwarded.get("x-request-id") or getattr(body, "request_id", ""))


@dataclass(frozen=True)
class Bounds:
    """What a body may hold: bytes in all, bytes of text (None: unbounded), data: URLs."""

    max_body: int
    max_text: int | None
    media_strings: int

    @staticmethod
    def widest(bounds: list[Bounds]) -> Bounds:
        texts = [b.max_text for b in bounds]
        return Bounds(
            max(b.max_body for b in bounds),
            None if None in texts else max(texts),
            max(b.media_strings for b in bounds),
        )


class VLLMAnswer(Exception):
    """An answer in vLLM's own shape (a refused request) that ends a route early."""

    def __init__(self, response: Response):
        self.response = response


class RequestParser:
    def __init__(self, config: IrisConfig, decode: DeploymentHandle):
        self.models = request_models()
        self.decode = decode  # asked once for the engine's max_model_len (vLLM's, whatever derived it)
        self.max_tokens_limit = config.max_tokens_limit
        self.bytes_per_token = config.max_text_bytes_per_token
        self.fallback_model_len = config.engine_args.get("max_model_len")
        self.limits = {"image": config.max_images_per_prompt, "video": config.max_videos_per_prompt}
        # Room for every image and video as base64 (4/3 of its bytes); the text's room comes on top.
        self.max_media_bytes = (
            (
                config.max_images_per_prompt * config.media.max_image_bytes
                + config.max_videos_per_prompt * config.media.max_video_bytes
            )
            * 4
            // 3
        )
        self.max_model_len: int | None = None
        self.warned = False

    async def max_text_bytes(self) -> int | None:
        """Most bytes of a request's text (its body less its base64 media): max_model_len's worth, by
        LLMDecode's engine (asked once); by the config's engine_args while no decode replica answers."""
        if self.max_model_len is None:
            try:
                self.max_model_len = (await self.decode.limits.remote())["max_model_len"]
            except Exception as err:  # an LLMDecode of an older Iris (a rolling update), none up yet
                if not self.warned:
                    self.warned = True
                    logger.warning(
                        "max_model_len not known from LLMDecode (%s: %s); the config's: %s",
                        type(err).__name__,
                        err,
                        self.fallback_model_len,
                    )
                if self.fallback_model_len is None:
                    return None
                return self.fallback_model_len * self.bytes_per_token + TEXT_SLACK_BYTES
        return self.max_model_len * self.bytes_per_token + TEXT_SLACK_BYTES

    async def bounds(self) -> Bounds:
        max_text = await self.max_text_bytes()
        return Bounds(
            self.max_media_bytes + (max_text if max_text is not None else 1 << 20), max_text, sum(self.limits.values())
        )

    async def read(self, route: str, request: Request, bounds: Bounds | None = None) -> bytes:
        """The body's bytes, within this model's bounds or wider ones given (an app of several models
        reads a body before it knows the model). A text over the bound is dropped as it arrives."""
        bounds = bounds or await self.bounds()
        # No request may hold more data: URLs than its images and videos (a 400 too_many_* else).
        raw = await read_body(
            request.stream(),
            request.headers.get("content-length"),
            bounds.max_body,
            bounds.max_text,
            media_strings=bounds.media_strings,
        )
        if raw is None:  # over the bound before parsing: a huge text was dropped as it arrived
            raise self._text_too_long(route, bounds.max_text)
        return raw

    async def parse(
        self, route: str, request: Request, raw: bytes | None = None, body: dict | None = None
    ) -> tuple[Any, list[MediaItem]]:
        """The body and its media items; an IrisError for Iris's own refusals (`max_tokens_limit`
        included), VLLMAnswer for vLLM's (its handlers read `request.app.state.args`: the ingress sets it).
        `raw` and `body`: the request's bytes and JSON where already read."""
        from vllm.entrypoints.serve.exception_handling.handlers.exception import exception_handler
        from vllm.entrypoints.serve.exception_handling.handlers.validation import validation_exception_handler
        from vllm.exceptions import VLLMError

        if raw is None:
            bounds = await self.bounds()
            raw = await self.read(route, request, bounds)
            max_text = bounds.max_text
        else:
            max_text = await self.max_text_bytes()
        if body is None:
            body = await parse_body(raw)
        try:
            parsed, items = parse_request(self.models, route, body, self.limits)
        except ValidationError as err:  # as FastAPI reports a body that fails its model, to vLLM's handler
            errors = [{**e, "loc": ("body", *e["loc"])} for e in err.errors(include_url=False)]
            raise VLLMAnswer(await validation_exception_handler(request, RequestValidationError(errors))) from None
        except (ValueError, TypeError, VLLMError) as err:  # raised by vLLM's own validators, past pydantic
            raise VLLMAnswer(await exception_handler(request, err)) from None
        if max_text is not None:  # a text that held `"data:` strings: only media parts' URLs are not text
            # (each '/' of a URL may have come as `\/`: counted as two bytes, the text is not overcounted)
            urls = sum(len(i.url) + i.url.count("/") for i in items if i.url is not None)
            if len(raw) - urls > max_text:
                raise self._text_too_long(route, max_text)
        check_max_tokens(parsed, self.max_tokens_limit)
        return parsed, items

    def _text_too_long(self, route: str, max_text: int) -> IrisError:
        model_len = self.max_model_len or self.fallback_model_len
        return IrisError(
            f"This request's text (its body less its base64 images and videos) is more than the {max_text} "
            f"bytes that a prompt of this model's maximum context length, {model_len} tokens, can take at "
            f"{self.bytes_per_token} bytes a token. Please reduce the length of the input.",
            status_code=400,
            param=TEXT_PARAM.get(route),
            code="context_length_exceeded",
        )
