"""Per-token logprobs in the shapes vLLM's OpenAI server gives them.

Mirrors `OpenAIServingChat._create_chat_logprobs` and
`OpenAIServingCompletion._create_completion_logprobs` (vLLM 0.32), minus the
token-id placeholders Iris does not offer.
"""

from __future__ import annotations

from typing import Any


def _token(lp: Any, token_id: int, tokenizer) -> str:
    return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([token_id])


def chat_logprobs(token_ids, steps, tokenizer, top_n: int | None) -> list[dict]:
    """`choices[i].logprobs.content` entries for these tokens; `steps[i]` is vLLM's {token_id: Logprob}."""
    out = []
    for token_id, step in zip(token_ids, steps):
        if step is None or step.get(token_id) is None:
            token = tokenizer.decode(token_id)
            out.append({"token": token, "logprob": -9999.0, "bytes": list(token.encode("utf-8", errors="replace")),
                        "top_logprobs": []})
            continue
        lp = step[token_id]
        top = [{"token": (t := _token(p, tid, tokenizer)), "logprob": max(p.logprob, -9999.0),
                "bytes": list(t.encode("utf-8", errors="replace"))}
               for i, (tid, p) in enumerate(step.items())
               if top_n == -1 or (top_n is not None and i < top_n)]
        out.append({"token": _token(lp, token_id, tokenizer), "logprob": max(lp.logprob, -9999.0),
                    "bytes": None if lp.decoded_token is None else list(lp.decoded_token.encode("utf-8", errors="replace")),
                    "top_logprobs": top})
    return out


def completion_logprobs(token_ids, steps, tokenizer, top_n: int, text_offset: int = 0) -> dict:
    """`choices[i].logprobs` of /v1/completions for these tokens (`tokens`, `token_logprobs`,
    `top_logprobs`, `text_offset`); `text_offset` is where the first token starts in the choice's
    text, so a stream's deltas continue the offsets of the tokens before them."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, step in zip(token_ids, steps):
        if step is None:
            token, logprob, top = tokenizer.decode(token_id), None, None
        else:
            token = _token(step[token_id], token_id, tokenizer)
            logprob = max(step[token_id].logprob, -9999.0)
            # The sampled token plus the top `top_n` (OpenAI's rule): at most top_n + 1 entries.
            top = {_token(p, tid, tokenizer): max(p.logprob, -9999.0)
                   for i, (tid, p) in enumerate(step.items()) if top_n == -1 or i <= top_n}
        out["tokens"].append(token)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(token)
    return out


def next_text_offset(logprobs: dict, start: int) -> int:
    """Where the token after these completion logprobs starts (`start` when they hold no token)."""
    if not logprobs["tokens"]:
        return start
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def extend_completion_logprobs(into: dict | None, more: dict) -> dict:
    """Completion logprobs of consecutive deltas, joined into one."""
    if into is None:
        return {k: list(v) for k, v in more.items()}
    for k, v in more.items():
        into[k].extend(v)
    return into
