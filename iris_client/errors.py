"""The one error of the client's own: images the server does not hold, and the client cannot (or
could not, after one resend) give it."""

from __future__ import annotations

import openai


class CacheMissError(openai.ConflictError):
    """409 mm_cache_miss that the client did not resolve: `missing` are the image indexes (in
    request order) still missing, after the one resend or because the client has no bytes for them."""

    def __init__(self, message: str, missing: list[int], cause: openai.ConflictError):
        super().__init__(message, response=cause.response, body=cause.body)
        self.missing = missing


def missing_of(err: openai.ConflictError) -> list[int] | None:
    """The indexes a 409 mm_cache_miss lists; None for any other 409."""
    body = err.body if isinstance(err.body, dict) else {}
    if body.get("code") != "mm_cache_miss" or not isinstance(body.get("missing"), list):
        return None
    return [int(i) for i in body["missing"]]
