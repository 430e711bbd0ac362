"""Each family knows what its encoder's features look like (pipeline/families, no Ray).

The real encoder output of each tiny checkpoint passes `feature_problem`; the
same features with a wrong dtype, hidden size, token count or grid do not.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from cache_service.codec import Features
from pipeline.families import adapter_for

FAMILIES = ["llava", "qwen2_vl", "qwen2_5_vl"]


@pytest.fixture(scope="module", params=FAMILIES)
def encoded(request, tiny_checkpoint):
    adapter = adapter_for(tiny_checkpoint(request.param))
    adapter.load_vision()
    images = [Image.new("RGB", (64, 48), (200, 10, 10)), Image.new("RGB", (120, 90), (10, 200, 10))]
    features = adapter.encode([adapter.preprocess(im) for im in images])
    dtype = next(adapter.vision.parameters()).dtype
    return adapter, features, dtype


def _with(features: Features, **tensors) -> Features:
    return Features({**features.tensors, **tensors}, dict(features.meta))


def test_real_encoder_output_is_accepted(encoded):
    adapter, features, dtype = encoded
    for f in features:
        assert adapter.feature_problem(f, dtype) is None


def test_wrong_dtype_hidden_size_and_token_count_are_refused(encoded):
    adapter, features, dtype = encoded
    f = features[0]
    embeds = f.tensors["image_embeds"]
    other_dtype = torch.bfloat16 if dtype != torch.bfloat16 else torch.float16
    cases = {
        "dtype": _with(f, image_embeds=embeds.to(other_dtype)),
        "hidden": _with(f, image_embeds=torch.zeros(embeds.shape[0], embeds.shape[1] + 1, dtype=dtype)),
        "tokens": _with(f, image_embeds=torch.zeros(embeds.shape[0] - 1, embeds.shape[1], dtype=dtype)),
        "meta": Features(f.tensors, {**f.meta, "num_tokens": 100_000}),
        "missing": Features({}, f.meta),
        "extra": _with(f, extra=torch.zeros(1)),
    }
    for name, bad in cases.items():
        assert adapter.feature_problem(bad, dtype), name


def test_qwen_grid_must_match_the_embeddings(encoded):
    adapter, features, dtype = encoded
    if "image_grid_thw" not in features[0].tensors:
        pytest.skip("fixed-size family")
    f = features[0]
    t, h, w = (int(x) for x in f.tensors["image_grid_thw"][0])
    for grid in ([[t, h + 2, w]], [[t, h + 1, w]], [[0, h, w]], [[t, h, w, 1]]):
        assert adapter.feature_problem(_with(f, image_grid_thw=torch.tensor(grid)), dtype), grid
    assert adapter.feature_problem(_with(f, image_grid_thw=f.tensors["image_grid_thw"].to(torch.int32)), dtype)
