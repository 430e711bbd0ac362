"""Iris's own bound on generated tokens (`max_tokens_limit`), checked before any media work.
Everything else about sampling is vLLM's: its request models and serving layer."""

from __future__ import annotations

from typing import Any

from pipeline.errors import bad_request

# Where each of vLLM's request models says how many tokens to generate, first wins (as vLLM reads them).
MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_output_tokens", "max_tokens")


def _max_tokens_field(req: Any) -> str | None:
    return next((name for name in MAX_TOKENS_FIELDS if getattr(req, name, None) is not None), None)


def check_max_tokens(req: Any, limit: int | None) -> None:
    """400 naming the parameter when a request asks for more tokens than the server allows
    (OpenAI's wording and code for the same refusal)."""
    param = _max_tokens_field(req)
    wanted = getattr(req, param) if param else None
    if limit is None or wanted is None or wanted <= limit:
        return
    raise bad_request(
        f"{param} is too large: {wanted}. This server allows at most {limit} completion tokens "
        f"per request, whereas you provided {wanted}.",
        param=param,
        code="invalid_value",
    )
