"""Iris's own bound on generated tokens (`max_tokens_limit`), checked before any media work.
Everything else about sampling is vLLM's: its request models and serving layer."""

from __future__ import annotations

from typing import Any

from pipeline.errors import bad_request


def max_tokens_of(req: Any) -> int | None:
    return req.max_completion_tokens if getattr(req, "max_completion_tokens", None) is not None else req.max_tokens


def check_max_tokens(req: Any, limit: int | None) -> None:
    """400 naming the parameter when a request asks for more tokens than the server allows
    (OpenAI's wording and code for the same refusal)."""
    wanted = max_tokens_of(req)
    if limit is None or wanted is None or wanted <= limit:
        return
    param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    raise bad_request(f"{param} is too large: {wanted}. This server allows at most {limit} completion tokens "
                      f"per request, whereas you provided {wanted}.", param=param, code="invalid_value")
