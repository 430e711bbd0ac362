"""An HTTP request's body as vLLM's request model, with its images and videos (one MediaItem
each), or the refusal `vllm serve` would answer with, in its shape (VLLMAnswer).

Iris's own refusals stay IrisErrors: a body too large (413) or not JSON, a malformed media part."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from deployments.config import IrisConfig
from pipeline.api.body import read_json_body
from pipeline.api.media_parts import MediaItem, parse_request, request_models
from pipeline.api.sampling import check_max_tokens


# What vLLM reads of an HTTP request's headers (its request id; the trace context travels apart).
FORWARDED_HEADERS = ("x-request-id",)
ANSWER_ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-"}  # vLLM's, before the request id


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


class VLLMAnswer(Exception):
    """An answer in vLLM's own shape (a refused request) that ends a route early."""

    def __init__(self, response: Response):
        self.response = response


class RequestParser:
    def __init__(self, config: IrisConfig):
        self.models = request_models()
        self.max_tokens_limit = config.max_tokens_limit
        self.limits = {"image": config.max_images_per_prompt, "video": config.max_videos_per_prompt}
        # Room for every image and video as base64 (4/3 of its bytes) plus 1 MiB of text.
        self.max_body_bytes = (config.max_images_per_prompt * config.media.max_image_bytes
                               + config.max_videos_per_prompt * config.media.max_video_bytes) * 4 // 3 + (1 << 20)

    async def parse(self, route: str, request: Request) -> tuple[Any, list[MediaItem]]:
        """The body and its media items; an IrisError for Iris's own refusals (`max_tokens_limit`
        included), VLLMAnswer for vLLM's (its handlers read `request.app.state.args`: the ingress sets it)."""
        from vllm.entrypoints.serve.exception_handling.handlers.exception import exception_handler
        from vllm.entrypoints.serve.exception_handling.handlers.validation import validation_exception_handler
        from vllm.exceptions import VLLMError

        body = await read_json_body(request.stream(), request.headers.get("content-length"), self.max_body_bytes)
        try:
            parsed, items = parse_request(self.models, route, body, self.limits)
        except ValidationError as err:  # as FastAPI reports a body that fails its model, to vLLM's handler
            errors = [{**e, "loc": ("body", *e["loc"])} for e in err.errors(include_url=False)]
            raise VLLMAnswer(await validation_exception_handler(request, RequestValidationError(errors))) from None
        except (ValueError, TypeError, VLLMError) as err:  # raised by vLLM's own validators, past pydantic
            raise VLLMAnswer(await exception_handler(request, err)) from None
        check_max_tokens(parsed, self.max_tokens_limit)
        return parsed, items
