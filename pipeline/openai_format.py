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


def completion(request_id: str, model: str, text: str, finish_reason: str | None, usage: Usage) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }],
        "usage": usage.to_dict(),
    }


def chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None,
          usage: Usage | None = None, choices: bool = True) -> str:
    """One SSE event; `choices=False` gives the trailing usage-only chunk."""
    body = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        if choices else [],
    }
    if usage is not None:
        body["usage"] = usage.to_dict()
    return sse(body)


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
