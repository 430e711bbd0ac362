"""`POST /tokenize` and `POST /detokenize` as `vllm serve` has them.

Bodies are validated by vLLM's own protocol models (`TokenizeCompletionRequest`,
`TokenizeChatRequest`, `DetokenizeRequest`); chat messages are then parsed by
Iris's chat parser, so /tokenize counts exactly the prompt /v1/chat/completions
would build. LLMDecode, which owns the tokenizer, does the work.

Refused with a 400 naming them: the chat-template overrides and `tools` (as on
/v1/chat/completions), and images: vLLM counts an image's expanded tokens by
running its processor on the image, which Iris does only in Preprocess and the
encoder, not for a count.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from pipeline.api.chat_prompt import messages_for_template
from pipeline.api.chat_request import ChatBody, parse_messages
from pipeline.api.errors import bad_request, validation_error, vllm_refusal
from pipeline.api.sampling import refuse_unhonoured

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "continue_final_message", "return_token_strs"})


@dataclass
class TokenizeJob:
    model: str | None
    prompt: str | None  # a text prompt, or
    messages: list[dict] | None  # chat-template messages (text only)
    add_special_tokens: bool
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


def parse_tokenize_request(body: dict, max_images: int) -> TokenizeJob:
    """A /tokenize body as a TokenizeJob; IrisError 400 on anything vLLM refuses or Iris cannot honour."""
    from vllm.entrypoints.serve.tokenize.protocol import (
        TokenizeChatRequest,
        TokenizeRequest,
    )

    req = _validate(TokenizeRequest, body)
    refuse_unhonoured(req, TOKENIZE_FIELDS)
    if not isinstance(req, TokenizeChatRequest):
        return TokenizeJob(req.model, req.prompt, None, req.add_special_tokens,
                           return_token_strs=bool(req.return_token_strs))
    try:
        parsed = ChatBody.model_validate({"messages": body["messages"]})
    except ValidationError as e:
        raise validation_error(e) from None
    messages, media = parse_messages(parsed.messages, {"image": max_images, "video": max_images})
    if media:
        raise bad_request("/tokenize does not count images or videos on this server: send text-only messages "
                          "(each image or video adds its feature tokens, as the chat completion's usage reports)",
                          param="messages", code="unsupported_parameter")
    return TokenizeJob(req.model, None, messages_for_template(messages), req.add_special_tokens,
                       req.add_generation_prompt, req.continue_final_message, bool(req.return_token_strs))


def parse_detokenize_request(body: dict):
    """vLLM's validated DetokenizeRequest (`model`, `tokens`); IrisError 400 otherwise."""
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

    return _validate(DetokenizeRequest, body)


def _validate(model, body: dict):
    from pydantic import TypeAdapter
    from vllm.exceptions import VLLMClientError

    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return TypeAdapter(model).validate_python(body)
    except ValidationError as e:
        raise validation_error(e) from None
    except (ValueError, TypeError, VLLMClientError) as e:  # vLLM's validators may raise past pydantic
        raise vllm_refusal(e) from None
