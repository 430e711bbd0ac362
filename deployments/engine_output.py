"""vLLM's engine outputs for one request -> Iris's DecodeChunks: token deltas merged per
`stream_interval_s` (one Ray message per token costs more than the token on a busy node; the
first goes at once), one chunk per choice with its text, logprobs in the API's shape, finish
reason, and the token counts on the last; and the engine's refusals of the request's input as
400s, as `vllm serve` answers them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from deployments.stage_trace import mark
from pipeline.api.errors import IrisError, bad_request, causes, vllm_refusal
from pipeline.api.logprobs import (
    chat_logprobs,
    completion_logprobs,
    extend_completion_logprobs,
    next_text_offset,
)
from pipeline.api.stream_merge import merged_outputs
from pipeline.stage_io import DecodeChunk, DecodeRequest


class OutputAdapter:
    def __init__(self, tokenizer, system_fingerprint: str | None, stream_interval_s: float,
                 on_finished: Callable[[DecodeChunk], None]):
        self.tokenizer = tokenizer
        self.system_fingerprint = system_fingerprint  # what `vllm serve` stamps on a choice's last chunk
        self.stream_interval_s = stream_interval_s
        self.on_finished = on_finished  # the request's last chunk, with its token counts (metrics)

    async def chunks(self, outputs: AsyncIterator, request: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        """The request's chunks from the engine's `generate` stream; closing this aborts the engine request."""
        req = request.sampling
        # Chat: `logprobs` is a flag and `top_logprobs` the count; completions: `logprobs` is the count.
        text_api = request.prompt is not None
        top_n = req.logprobs if text_api else (req.top_logprobs if req.logprobs else None)
        text_offsets: dict[int, int] = {}  # choice -> where its next token starts in its text (completions)
        completion_tokens = 0
        mark("decode.engine_call", request.request_id)
        try:
            async with aclosing(merged_outputs(outputs, self.stream_interval_s)) as merged:
                async for outs in merged:
                    if completion_tokens == 0:
                        mark("decode.first_output", request.request_id)
                    choices: dict[int, DecodeChunk] = {}
                    for o in outs:
                        for c in o.outputs:
                            ch = choices.setdefault(c.index, DecodeChunk(index=c.index))
                            ch.text += c.text
                            completion_tokens += len(c.token_ids)
                            if c.logprobs is not None and top_n is not None and text_api:
                                lp = completion_logprobs(c.token_ids, c.logprobs, self.tokenizer, top_n,
                                                         text_offsets.get(c.index, 0))
                                text_offsets[c.index] = next_text_offset(lp, text_offsets.get(c.index, 0))
                                ch.logprobs = extend_completion_logprobs(ch.logprobs, lp)
                            elif c.logprobs is not None and top_n is not None:
                                ch.logprobs = (ch.logprobs or []) + chat_logprobs(c.token_ids, c.logprobs,
                                                                                  self.tokenizer, top_n)
                            if c.finish_reason:
                                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
                                ch.system_fingerprint = self.system_fingerprint
                    out = outs[-1]
                    chunks = [choices[i] for i in sorted(choices)] or [DecodeChunk()]
                    if out.finished:
                        last = chunks[-1]
                        last.done = True
                        last.prompt_tokens = len(out.prompt_token_ids or [])
                        last.completion_tokens = completion_tokens
                        last.cached_tokens = out.num_cached_tokens or 0
                        self.on_finished(last)
                    for ch in chunks:
                        yield ch
        except Exception as err:
            refusal = input_refusal(err)
            if refusal is None:
                raise
            yield DecodeChunk(error=refusal)


def input_refusal(err: Exception) -> IrisError | None:
    """The 400 for an engine error that is the request's input's fault, or None (a fault of the server)."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineGenerateError

    if isinstance(err, (ValueError, VLLMClientError)):  # vLLM's input validation: prompt too long, bad schema
        return vllm_refusal(err, param="messages", code="invalid_prompt")
    if isinstance(err, EngineGenerateError):
        # vLLM asserts that the prompt has a placeholder for every item (`vllm serve` answers 500):
        # a chat template that places no videos, say. The request's input, not a fault.
        cause = next((c for c in causes(err.__cause__) if "Failed to apply prompt replacement" in str(c)), None)
        if cause is not None:
            return bad_request(f"this model's chat template places no token for an item of the request, so the "
                               f"model cannot take it ({cause})", param="messages", code="invalid_prompt")
    return None
