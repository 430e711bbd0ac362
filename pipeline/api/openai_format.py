"""OpenAI responses built from LLMDecode's chunks, as vLLM's own response models.

`vllm serve` answers with these models; Iris fills the same ones, so its fields and
their JSON are vLLM's: whole answers dumped in full, stream chunks without unset
fields, as vLLM's serving code does. (Errors keep Iris's shape, pipeline/api/errors.py:
OpenAI's error object has a string `code` such as "mm_cache_miss", where vLLM's
ErrorInfo types `code` as the HTTP status.)
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi.responses import Response
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import (
    ModelCard,
    ModelList,
    ModelPermission,
    OpenAIBaseModel,
    PromptTokenUsageInfo,
    UsageInfo,
)

from pipeline.api.logprobs import extend_completion_logprobs
from pipeline.stage_io import DecodeChunk

DONE = "data: [DONE]\n\n"
# Unicode line breaks that JSON leaves raw in strings but line readers (str.splitlines, httpx's
# iter_lines) split on, cutting an event in two: escaped, they stay the same JSON string.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(body: OpenAIBaseModel | dict, exclude_none: bool = False) -> str:
    """One server-sent event; a model without its unset fields (vLLM's stream chunks)."""
    if isinstance(body, dict):
        data = json.dumps(body, ensure_ascii=False)
    else:
        data = body.model_dump_json(exclude_unset=True, exclude_none=exclude_none)
    return f"data: {data.translate(_LINE_BREAKS)}\n\n"


def usage(last: DecodeChunk) -> UsageInfo:
    """The token counts the request's last chunk carries (cached: vLLM's prefix-cache hits)."""
    return UsageInfo(prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
                     total_tokens=last.prompt_tokens + last.completion_tokens,
                     prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=last.cached_tokens))


def model_list(name: str, max_model_len: int | None) -> ModelList:
    """`/v1/models` with the fields `vllm serve` lists (clients such as `vllm bench serve` read them)."""
    return ModelList(data=[ModelCard(id=name, root=name, max_model_len=max_model_len,
                                     permission=[ModelPermission()])])


# --- whole answers ------------------------------------------------------------------

@dataclass
class ChoiceSoFar:
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict] | dict | None = None  # chat entries, or completions' columns


@dataclass
class Answer:
    """A non-streamed answer gathered from its chunks."""
    choices: dict[int, ChoiceSoFar] = field(default_factory=dict)
    usage: UsageInfo = field(default_factory=UsageInfo)
    system_fingerprint: str | None = None

    @classmethod
    async def gather(cls, chunks: AsyncIterator[DecodeChunk]) -> Answer:
        """Every chunk of the stream; raises the engine's error should one carry it."""
        answer = cls()
        async for c in chunks:
            if c.error:
                raise c.error
            choice = answer.choices.setdefault(c.index, ChoiceSoFar())
            choice.text.append(c.text)
            if isinstance(c.logprobs, list):
                choice.logprobs = (choice.logprobs or []) + c.logprobs
            elif c.logprobs is not None:
                choice.logprobs = extend_completion_logprobs(choice.logprobs, c.logprobs)
            if c.finish_reason:
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
                answer.system_fingerprint = c.system_fingerprint
            if c.done:
                answer.usage = usage(c)
        return answer

    def chat(self, request_id: str, model: str) -> ChatCompletionResponse:
        return ChatCompletionResponse(id=request_id, model=model, usage=self.usage,
                                      system_fingerprint=self.system_fingerprint, choices=[
            ChatCompletionResponseChoice(
                index=i, message=ChatMessage(role="assistant", content="".join(c.text)),
                logprobs=None if c.logprobs is None else ChatCompletionLogProbs(content=c.logprobs),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            for i, c in sorted(self.choices.items())])

    def text(self, request_id: str, model: str) -> CompletionResponse:
        return CompletionResponse(id=request_id, model=model, usage=self.usage,
                                  system_fingerprint=self.system_fingerprint, choices=[
            CompletionResponseChoice(
                index=i, text="".join(c.text), finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                logprobs=None if c.logprobs is None else CompletionLogProbs(**c.logprobs))
            for i, c in sorted(self.choices.items())])


# --- streams ------------------------------------------------------------------------

async def _messages(chunks: AsyncIterator[DecodeChunk], event: Callable[..., str],
                    choice: Callable[[DecodeChunk], object], first: list[str], include_usage: bool
                    ) -> AsyncIterator[str]:
    """A stream's messages: one per chunk, its events joined (Serve's proxy sends each string as a
    message of its own: fewer is faster), `first` before the first chunk's; [DONE] ends the last
    chunk's, or the stream should the last chunk never come. A chunk with text, logprobs or a
    finish reason is an event of `choice(chunk)`; the last one adds the usage when asked for. The
    system fingerprint goes with the usage, else with the finishing choice, as vLLM's serving code
    does. Raises the engine's error should a chunk carry it."""
    pending, fingerprint = first, None
    async for c in chunks:
        if c.error:
            raise c.error
        events, pending = list(pending), []
        if c.text or c.finish_reason or c.logprobs:
            extra = {}
            if c.finish_reason is not None:
                fingerprint = c.system_fingerprint
                if fingerprint is not None and not include_usage:
                    extra["system_fingerprint"] = fingerprint
            events.append(event([choice(c)], **extra))
        if c.done and include_usage:
            events.append(event([], exclude_none=True, usage=usage(c), system_fingerprint=fingerprint))
        if c.done:
            yield "".join(events) + DONE
            return
        if events:
            yield "".join(events)
    yield "".join(pending) + DONE


def chat_events(chunks: AsyncIterator[DecodeChunk], request_id: str, model: str, n: int,
                include_usage: bool) -> AsyncIterator[str]:
    """A chat answer's events, in messages as _messages: the role first, then the deltas, then
    the usage when asked for, then [DONE]; the fields vLLM's serving code sets on each."""
    created = int(time.time())

    def event(choices: list, exclude_none: bool = False, **extra) -> str:  # unset fields are left out
        return sse(ChatCompletionStreamResponse(id=request_id, object="chat.completion.chunk", created=created,
                                                model=model, choices=choices, **extra), exclude_none)

    def choice(c: DecodeChunk) -> ChatCompletionResponseStreamChoice:
        delta = ChatCompletionResponseStreamChoice(
            index=c.index, delta=DeltaMessage(content=c.text) if c.text else DeltaMessage(),
            logprobs=None if c.logprobs is None else ChatCompletionLogProbs(content=c.logprobs),
            finish_reason=c.finish_reason, token_ids=None)
        if c.finish_reason is not None:
            delta.stop_reason = c.stop_reason
        return delta

    roles = [event([ChatCompletionResponseStreamChoice(
        index=i, delta=DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None)],
        prompt_token_ids=None, prompt_text=None) for i in range(n)]
    return _messages(chunks, event, choice, roles, include_usage)


def text_events(chunks: AsyncIterator[DecodeChunk], request_id: str, model: str,
                include_usage: bool) -> AsyncIterator[str]:
    """A /v1/completions answer's events, in messages as _messages, [DONE] last."""
    created = int(time.time())

    def event(choices: list, exclude_none: bool = False, **extra) -> str:
        return sse(CompletionStreamResponse(id=request_id, object="text_completion", created=created,
                                            model=model, choices=choices, **extra), exclude_none)

    def choice(c: DecodeChunk) -> CompletionResponseStreamChoice:
        return CompletionResponseStreamChoice(
            index=c.index, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            logprobs=None if c.logprobs is None else CompletionLogProbs(**c.logprobs),
            prompt_token_ids=None, token_ids=None)

    return _messages(chunks, event, choice, [], include_usage)


@dataclass
class Reply:
    """How an opened answer goes out: streamed as `events(chunks)`, or whole as `whole(answer)`."""
    stream: bool
    events: Callable[[AsyncIterator], AsyncIterator[str]]
    whole: Callable[[Answer], object]
    headers: dict | None = None


def json_response(model, headers: dict | None = None) -> Response:
    """A vLLM response model in full, as `vllm serve` sends it."""
    return Response(model.model_dump_json(), media_type="application/json", headers=headers)
