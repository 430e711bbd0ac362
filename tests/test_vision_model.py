"""VisionModel without Ray: vLLM's processor, encoder-only model and embedding form
for each served family, for images and (where vLLM takes them) videos; what its
features must look like; the fingerprint the decoder agrees with the encoder;
families vLLM takes no embeddings for, refused."""

from __future__ import annotations

import pytest
import torch

from cache_service.codec import Features
from pipeline.models.builtin import BUILDERS, SERVED_FAMILIES
from pipeline.vision_model import VisionModel
from tests.support.images import SIZES, make_image
from tests.support.videos import clip_bytes

UNSERVED = [family for family, builtin in BUILDERS.items() if not builtin.served]
# Families vLLM 0.32 takes video embeddings for (InternVL: it takes videos, but not their features back).
TAKES_VIDEO = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "minicpmv4_6"}


@pytest.fixture(scope="module", params=SERVED_FAMILIES)
def encoded(request, tiny_checkpoint):
    """(vision, features): two images and, where the model takes video, one clip, in one batch."""
    vision = VisionModel(tiny_checkpoint(request.param))
    vision.load_encoder()
    assert ("video" in vision.modalities) == (request.param in TAKES_VIDEO), vision.modalities
    items = [(make_image(*SIZES[n]), "image") for n in ("wide", "tall")]
    if "video" in vision.modalities:
        items.append((vision.load_video(clip_bytes()), "video"))
    features = vision.encode([vision.preprocess(media, modality) for media, modality in items])
    assert [f.meta.get("modality", "image") for f in features] == [m for _, m in items]
    return vision, features


def _form(vision: VisionModel, features: Features):
    return vision.forms[features.meta.get("modality", "image")]


def _with(features: Features, **tensors) -> Features:
    return Features({**features.tensors, **tensors}, dict(features.meta))


def test_real_encoder_output_is_accepted(encoded):
    vision, features = encoded
    for f in features:
        form = _form(vision, f)
        assert vision.feature_problem(f) is None
        assert f.tensors[form.values_field].shape == (f.meta["num_tokens"], form.width)


def test_wrong_dtype_width_token_count_names_and_modality_are_refused(encoded):
    vision, features = encoded
    for f in (features[0], features[-1]):  # an image, and the clip where there is one
        values_field = _form(vision, f).values_field
        values = f.tensors[values_field]
        other_dtype = torch.bfloat16 if values.dtype != torch.bfloat16 else torch.float16
        other_modality = "image" if f.meta.get("modality") == "video" else "video"
        cases = {
            "dtype": _with(f, **{values_field: values.to(other_dtype)}),
            "width": _with(f, **{values_field: torch.zeros(values.shape[0], values.shape[1] + 1, dtype=values.dtype)}),
            "tokens": _with(f, **{values_field: values[:-1]}),
            "meta": Features(f.tensors, {**f.meta, "num_tokens": 100_000}),
            "missing": Features({}, f.meta),
            "extra": _with(f, extra=torch.zeros(1)),
            "3-d": _with(f, **{values_field: values.unsqueeze(0)}),
            "modality": Features(f.tensors, {**f.meta, "modality": other_modality}),
        }
        for name, bad in cases.items():
            assert vision.feature_problem(bad), name


def test_metadata_must_match_the_embeddings(encoded):
    """Families whose placeholder is sized from metadata (Qwen's patch grid, frame timestamps):
    vLLM's own processor sizes it, and metadata that does not fit the rows is refused."""
    vision, features = encoded
    checked = 0
    for f in features:
        for name in _form(vision, f).metadata_fields:
            meta = f.tensors[name]
            # (Values of float metadata, e.g. Qwen3-VL's frame timestamps, size nothing: any will do.)
            values = [] if meta.is_floating_point() else [meta * 2 + 1]
            for bad in (*values, meta[:-1], meta.to(torch.int32 if meta.dtype != torch.int32 else torch.int64)):
                assert vision.feature_problem(_with(f, **{name: bad})), (name, bad)
            checked += 1
    assert checked or not any(form.metadata_fields for form in vision.forms.values())


def test_decoder_and_encoder_agree_on_the_fingerprint(encoded, tiny_checkpoint):
    vision, _ = encoded
    decoder = VisionModel(vision.checkpoint)
    assert decoder.expected_fingerprint() == vision.fingerprint()
    assert decoder.model is None  # the tower is dropped again
    assert decoder.forms == vision.forms and decoder.modalities == vision.modalities
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
    with pytest.raises(ValueError, match="does not take this model's image features back as embeddings"):
        vision.load_encoder()
