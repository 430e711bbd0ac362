"""VisionModel without Ray: vLLM's processor, encoder-only model and embedding form
for each served family; what its features must look like; the fingerprint the
decoder agrees with the encoder; families vLLM takes no embeddings for, refused."""

from __future__ import annotations

import pytest
import torch

from cache_service.codec import Features
from pipeline.models.builtin import BUILDERS, SERVED_FAMILIES
from pipeline.vision_model import VisionModel
from tests.support.images import SIZES, make_image

UNSERVED = [family for family, builtin in BUILDERS.items() if not builtin.served]


@pytest.fixture(scope="module", params=SERVED_FAMILIES)
def encoded(request, tiny_checkpoint):
    vision = VisionModel(tiny_checkpoint(request.param))
    vision.load_encoder()
    features = vision.encode([vision.preprocess(make_image(*SIZES[n])) for n in ("wide", "tall")])
    return vision, features


def _with(features: Features, **tensors) -> Features:
    return Features({**features.tensors, **tensors}, dict(features.meta))


def test_real_encoder_output_is_accepted(encoded):
    vision, features = encoded
    for f in features:
        assert vision.feature_problem(f) is None
        assert f.tensors[vision.values_field].shape == (f.meta["num_tokens"], vision.feature_width)


def test_wrong_dtype_width_token_count_and_names_are_refused(encoded):
    vision, features = encoded
    f = features[0]
    values = f.tensors[vision.values_field]
    other_dtype = torch.bfloat16 if values.dtype != torch.bfloat16 else torch.float16
    cases = {
        "dtype": _with(f, **{vision.values_field: values.to(other_dtype)}),
        "width": _with(f, **{vision.values_field: torch.zeros(values.shape[0], values.shape[1] + 1,
                                                              dtype=values.dtype)}),
        "tokens": _with(f, **{vision.values_field: values[:-1]}),
        "meta": Features(f.tensors, {**f.meta, "num_tokens": 100_000}),
        "missing": Features({}, f.meta),
        "extra": _with(f, extra=torch.zeros(1)),
        "3-d": _with(f, **{vision.values_field: values.unsqueeze(0)}),
    }
    for name, bad in cases.items():
        assert vision.feature_problem(bad), name


def test_metadata_must_match_the_embeddings(encoded):
    """Families whose placeholder is sized from metadata (Qwen's patch grid): vLLM's own
    processor sizes it, and a grid that does not fit the rows is refused."""
    vision, features = encoded
    if not vision.metadata_fields:
        pytest.skip("this family's embeddings carry no metadata")
    f = features[0]
    for name in vision.metadata_fields:
        meta = f.tensors[name]
        for bad in (meta * 2, meta[:-1], meta.to(torch.int32)):
            assert vision.feature_problem(_with(f, **{name: bad})), (name, bad)


def test_decoder_and_encoder_agree_on_the_fingerprint(encoded, tiny_checkpoint):
    vision, _ = encoded
    decoder = VisionModel(vision.checkpoint)
    assert decoder.expected_fingerprint() == vision.fingerprint()
    assert decoder.model is None  # the tower is dropped again
    assert decoder.feature_width == vision.feature_width
    other = "bfloat16" if vision.dtype != torch.bfloat16 else "float32"
    assert VisionModel(vision.checkpoint, other).expected_fingerprint() != vision.fingerprint()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fingerprint_covers_the_tower_weights(tmp_path, tiny_checkpoint, dtype):
    """A tower with the same shapes but other weights (a fine-tune) keys its images apart, also in
    bfloat16, where vLLM repacks the CPU linear weights after loading and leaves empty parameters."""
    import shutil

    from safetensors.torch import load_file, save_file

    original = VisionModel(tiny_checkpoint("llava"), dtype)
    original.load_encoder()
    copy = tmp_path / "tuned"
    shutil.copytree(tiny_checkpoint("llava"), copy)
    weights = load_file(str(copy / "model.safetensors"))
    name = next(n for n in weights if "vision_tower" in n and "mlp.fc1.weight" in n)
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert VisionModel(str(copy), dtype).expected_fingerprint() != original.fingerprint()


@pytest.mark.parametrize("family", UNSERVED)
def test_families_vllm_takes_no_embeddings_for_are_refused_at_start(family, tiny_checkpoint):
    vision = VisionModel(tiny_checkpoint(family))
    with pytest.raises(ValueError, match="does not take this model's image features back as image embeddings"):
        vision.load_encoder()
