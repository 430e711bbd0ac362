"""One exception type for every error a client can see, in OpenAI's error shape.

Everything below the HTTP layer raises IrisError; the ingress turns it into a
JSON response with `status_code` and `to_dict()` as the body, so OpenAI clients
can read `error.message`, `error.type`, `error.param` and `error.code`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Maps a status code to OpenAI's `type` when the caller does not give one.
_DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class IrisError(Exception):
    """An error with an HTTP status and OpenAI's error fields.

    `extra` holds additional fields placed beside the standard ones in the
    error object (e.g. `missing: [0, 2]` for a 409 `mm_cache_miss`); `headers`,
    HTTP headers the response carries (e.g. `Retry-After` for a 429).
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,  # an int where vLLM answers with one (its 404 for an unknown model)
        extra: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type or _DEFAULT_TYPES.get(
            status_code, "server_error" if status_code >= 500 else "invalid_request_error"
        )
        self.param = param
        self.code = code
        self.extra = dict(extra or {})
        self.headers = dict(headers or {})  # HTTP headers of the response, e.g. Retry-After of a 429
        # The standard keys must win: extra fields only add, never overwrite.
        clash = set(self.extra) & {"message", "type", "param", "code"}
        if clash:
            raise ValueError(f"extra fields may not override {sorted(clash)}")

    def to_dict(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        error.update(self.extra)
        return {"error": error}

    def __repr__(self) -> str:
        return (
            f"IrisError(status_code={self.status_code}, type={self.type!r}, "
            f"code={self.code!r}, param={self.param!r}, message={self.message!r})"
        )


def bad_request(message: str, param: str | None = None, code: str | None = None, **extra: Any) -> IrisError:
    """400 invalid_request_error: the client sent something we cannot serve."""
    return IrisError(message, status_code=400, param=param, code=code, extra=extra)


def server_error(message: str, code: str | None = None, status_code: int = 500) -> IrisError:
    """5xx server_error: our fault or a dependency's, never the client's."""
    return IrisError(message, status_code=status_code, type="server_error", code=code)


MODEL_CHANGED = "model_changed"


def model_changed() -> IrisError:
    """503: a stage keyed for other weights than its own (a rolling update); the client retries."""
    return IrisError(
        "the model was updated while this request was in flight; retry", status_code=503, code=MODEL_CHANGED
    )


def causes(err: BaseException | None, limit: int = 16) -> Iterator[BaseException]:
    """`err`, then what caused it, outermost first: the explicit cause, else the context, else a Ray
    task error's `cause`."""
    for _ in range(limit):
        if err is None:
            return
        yield err
        ray_cause = getattr(err, "cause", None)
        err = err.__cause__ or err.__context__ or (ray_cause if isinstance(ray_cause, BaseException) else None)
