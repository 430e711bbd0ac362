"""OpenAI chat-completions response bodies and server-sent-event chunks."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # vLLM prefix-cache hits, as OpenAI's prompt_tokens_details.cached_tokens

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def choice(index: int, text: str, finish_reason: str | None, stop_reason=None, logprobs: list | None = None) -> dict:
    """One non-streamed chat choice; `logprobs` are chat logprobs entries (pipeline/logprobs.py)."""
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def completion(request_id: str, model: str, choices: list[dict], usage: Usage) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage.to_dict(),
    }


def chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None,
          usage: Usage | None = None, choices: bool = True, index: int = 0,
          logprobs: list | None = None, stop_reason=None) -> str:
    """One SSE event; `choices=False` gives the trailing usage-only chunk."""
    c = {"index": index, "delta": delta, "logprobs": None if logprobs is None else {"content": logprobs},
         "finish_reason": finish_reason}
    if finish_reason is not None:
        c["stop_reason"] = stop_reason
    body = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [c] if choices else [],
    }
    if usage is not None:
        body["usage"] = usage.to_dict()
    return sse(body)


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


# --- /v1/completions ---------------------------------------------------------


def text_choice(index: int, text: str, finish_reason: str | None, stop_reason=None,
                logprobs: dict | None = None) -> dict:
    """One /v1/completions choice; `logprobs` as pipeline/logprobs.py's completion_logprobs gives them."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def text_completion(request_id: str, model: str, choices: list[dict], usage: Usage) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage.to_dict()}


def text_chunk(request_id: str, model: str, choices: list[dict], usage: Usage | None = None) -> str:
    body = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices}
    if usage is not None:
        body["usage"] = usage.to_dict()
    return sse(body)
