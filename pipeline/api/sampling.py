"""Sampling parameters, validated by vLLM's own OpenAI request models.

Iris parses messages and images itself (uuid, upload-free, image limits); every
other field goes through vLLM's `ChatCompletionRequest` / `CompletionRequest`,
so parameters mean what they mean under `vllm serve` and follow vLLM upgrades.
LLMDecode turns the validated request into `SamplingParams` with
`to_sampling_params`, as vLLM's serving code does, since it needs the model's
generation config and the prompt length.

A field vLLM knows but Iris cannot honour (tools, beam search, prompt logprobs,
...) is a 400 naming it when set to anything but its default: never dropped.
Fields vLLM does not know are ignored, as vLLM ignores them.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pipeline.api.errors import bad_request, validation_error, vllm_refusal

# Fields of vLLM's request models that Iris honours with vLLM's meaning.
# Anything else vLLM knows is refused unless left at its default.
SAMPLING_FIELDS = frozenset({
    "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "logprobs", "top_logprobs", "min_tokens", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "response_format",
    "structured_outputs", "bad_words", "allowed_token_ids",
})
# Handled by Iris itself (chat_request.py) or with no effect on the answer.
OWN_FIELDS = frozenset({"messages", "prompt", "model", "stream", "stream_options", "user", "request_id"})


def _stub(body: dict, kind: str) -> dict:
    # Iris parses messages (images by uuid, image_url null) itself; vLLM's model
    # would reject upload-free parts and re-validate megabytes of base64.
    if kind == "chat":
        return {**body, "messages": [{"role": "user", "content": "x"}]}
    return body


def validate_sampling(body: dict, kind: str = "chat") -> Any:
    """vLLM's validated request (picklable) for `kind` "chat" or "completion"; IrisError 400 otherwise."""
    from vllm.exceptions import VLLMClientError

    if kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest as Model,
        )
    else:
        from vllm.entrypoints.openai.completion.protocol import (
            CompletionRequest as Model,
        )
    try:
        req = Model.model_validate(_stub(body, kind))
    except ValidationError as e:
        raise validation_error(e) from None
    except (ValueError, TypeError, VLLMClientError) as e:  # vLLM's validators raise VLLMValidationError past pydantic
        raise vllm_refusal(e) from None
    refuse_unhonoured(req, SAMPLING_FIELDS | OWN_FIELDS)
    try:  # SamplingParams checks ranges (n, top_p, temperature, ...): fail here, before any image work
        wanted = max_tokens_of(req)
        # Without max_tokens vLLM fills in what the context leaves; unknown here, so "plenty".
        req.to_sampling_params(wanted if wanted is not None else 1 << 20, {})
    except (ValueError, TypeError, VLLMClientError) as e:
        raise vllm_refusal(e) from None
    return req


def refuse_unhonoured(req: Any, honoured: frozenset[str]) -> None:
    """400 naming the first field of vLLM's request model `req` that the client set to a
    non-default value and that Iris does not honour (not in `honoured`)."""
    fields = type(req).model_fields
    # "tools" first: vLLM's validator sets tool_choice from it, but tools is what the client sent.
    known = req.model_fields_set & fields.keys()  # extras are ignored, as vLLM ignores them
    for name in sorted(known - honoured, key=lambda n: (n != "tools", n)):
        if getattr(req, name) != fields[name].get_default(call_default_factory=True):
            raise bad_request(f"{name} is not supported by this server", param=name,
                              code="unsupported_parameter")


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
