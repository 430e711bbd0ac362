"""pipeline/api/logprobs.py's completions shape against vLLM's own builder
(`OpenAIServingCompletion._create_completion_logprobs`), without an engine:
the same steps give the same body, whole or split into stream deltas."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.logprobs import Logprob

from pipeline.api.logprobs import (
    completion_logprobs,
    extend_completion_logprobs,
    next_text_offset,
)


class ByteTokenizer:
    def decode(self, ids):
        ids = [ids] if isinstance(ids, int) else ids
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


def steps_for(rng: random.Random, n_tokens: int, top_n: int):
    token_ids, steps = [], []
    for _ in range(n_tokens):
        sampled = rng.randrange(300)
        if rng.random() < 0.15:  # a step without logprobs
            token_ids.append(sampled)
            steps.append(None)
            continue
        others = rng.sample([t for t in range(300) if t != sampled], top_n)
        # vLLM's dict: the sampled token first, then the top ones (it may be among them)
        step = {sampled: Logprob(-rng.random() * 5, 1, None if rng.random() < 0.3 else chr(65 + sampled % 26) * 2)}
        for rank, t in enumerate(others, 1):
            step[t] = Logprob(float("-inf") if rng.random() < 0.1 else -rng.random() * 9, rank, None)
        token_ids.append(sampled)
        steps.append(step)
    return token_ids, steps


def vllm_builder(token_ids, steps, top_n, offset=0):
    server = SimpleNamespace(_get_decoded_token=OpenAIServingCompletion._get_decoded_token,
                             return_tokens_as_token_ids=False)
    return OpenAIServingCompletion._create_completion_logprobs(
        server, token_ids=token_ids, top_logprobs=steps, num_output_top_logprobs=top_n,
        tokenizer=ByteTokenizer(), initial_text_offset=offset).model_dump()


@pytest.mark.parametrize("top_n", [0, 1, 3, -1])
def test_completion_logprobs_match_vllm_whole_and_streamed(top_n):
    rng = random.Random(top_n)
    token_ids, steps = steps_for(rng, 30, 3 if top_n == -1 else top_n)
    tok = ByteTokenizer()
    assert completion_logprobs(token_ids, steps, tok, top_n) == vllm_builder(token_ids, steps, top_n)
    # Stream: deltas of 1-4 tokens, each continuing the previous one's offsets, as vLLM's stream does.
    joined, offset, expected_offset, i = None, 0, 0, 0
    while i < len(token_ids):
        j = i + rng.randint(1, 4)
        delta = completion_logprobs(token_ids[i:j], steps[i:j], tok, top_n, offset)
        ours_vllm = vllm_builder(token_ids[i:j], steps[i:j], top_n, expected_offset)
        assert delta == ours_vllm
        if ours_vllm["tokens"]:
            expected_offset = ours_vllm["text_offset"][-1] + len(ours_vllm["tokens"][-1])
        offset = next_text_offset(delta, offset)
        joined = extend_completion_logprobs(joined, delta)
        i = j
    assert joined == vllm_builder(token_ids, steps, top_n)
