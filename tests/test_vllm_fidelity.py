"""The fact the design rests on: features computed outside vLLM and given to it
as image embeddings produce the same greedy tokens as vLLM's own pixel path."""

import pytest

from tests.support.images import SIZES

FAMILIES = ["llava", "qwen2_vl", "qwen2_5_vl"]


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_generates_from_pixels(family, vllm_reference):
    results = vllm_reference(family)
    for name in SIZES:
        assert len(results[name]["pixel_tokens"]) > 0
    # The image matters: different images give different continuations.
    assert len({tuple(r["pixel_tokens"]) for r in results.values()}) == len(SIZES)


@pytest.mark.parametrize("family", FAMILIES)
def test_embeddings_path_equals_pixel_path(family, vllm_reference):
    for name, result in vllm_reference(family).items():
        assert result["embeds_tokens"] == result["pixel_tokens"], (family, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hits_for_repeated_embeddings(family, vllm_reference):
    for name, result in vllm_reference(family).items():
        assert result["prompt_tokens"] > result["block_size"]
        assert result["repeat_cached_tokens"] >= result["block_size"], (family, name)
        assert result["repeat_tokens"] == result["pixel_tokens"]
