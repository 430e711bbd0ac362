"""Per-token logprobs in the shapes vLLM's OpenAI server gives them.

Mirrors `OpenAIServingChat._create_chat_logprobs` and the completions variant
(vLLM 0.32), minus the token-id placeholders Iris does not offer.
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
