"""What vLLM's engine counted for the decode call being served (prompt, completion and
prefix-cached tokens): vLLM's serving layer calls the engine's `generate` for LLMDecode, and its
answers carry usage only when the client asks, so LLMDecode taps `generate` instead. The count
lives in the call's own context (Serve runs each call in a task of its own)."""

from __future__ import annotations

from contextlib import aclosing
from contextvars import ContextVar

from pipeline.stage_io import DecodeDone

_usage: ContextVar[DecodeDone | None] = ContextVar("iris_engine_usage", default=None)


def track() -> DecodeDone:
    """A fresh count for the call running in this context."""
    usage = DecodeDone()
    _usage.set(usage)
    return usage


def current() -> DecodeDone:
    return _usage.get() or DecodeDone()


def counting(generate):
    """The engine's `generate`, also counting each request's tokens into its caller's DecodeDone.
    Closing it closes the engine's stream, which aborts the engine request."""

    async def counted(*args, **kwargs):
        usage = _usage.get()
        async with aclosing(generate(*args, **kwargs)) as outputs:
            async for out in outputs:
                if usage is not None:
                    usage.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
                    if out.finished:
                        usage.prompt_tokens += len(out.prompt_token_ids or [])
                        usage.cached_tokens += out.num_cached_tokens or 0
                yield out

    return counted
