"""VisionModel without Ray: vLLM's processor, encoder-only model and embedding form
for each family, for images and (where vLLM's processor takes them) videos; how the
features reach the decoder (embeddings, or the EC connector where vLLM takes none);
what its features must look like; the fingerprint the decoder agrees with the encoder."""

from __future__ import annotations

import json

import pytest
import torch

from cache_service.features import Features
from pipeline.model.builtin import BUILDERS, FAMILIES
from pipeline.model.embedding_form import CONNECTOR, EMBEDDINGS, SOURCE
from pipeline.model.samples import sample_image_bytes
from pipeline.model.vision_model import VisionModel
from tests.support.images import png_bytes
from tests.support.videos import clip_bytes
from tests.test_families import takes_image_embeddings

# Families whose vLLM processor takes videos; vLLM 0.32 takes InternVL's back only through the connector.
TAKES_VIDEO = {
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_5",
    "qwen3_vl_moe",
    "qwen3_5_moe",
    "minicpmv4_6",
    "minicpmv4_7",
    "minicpmv",
    "internvl",
    "internvl_chat",
    "glm4v",
    "llava_onevision",
}
# MiniCPM-V's original format: vLLM reads a video embedding item's `video_image_sizes` both as one
# [width, height] (get_frame_size, minicpmv.py:556-558) and as one a frame (get_num_frames, :560-561),
# so a video's own features are refused (TypeError in the image processor's get_sliced_grid).
VIDEO_BY_CONNECTOR = {"internvl", "internvl_chat", "glm4v", "llava_onevision", "minicpmv4_7", "minicpmv"}


@pytest.fixture(scope="module", params=FAMILIES)
def encoded(request, tiny_checkpoint):
    """(vision, features): two images and, where the model takes video, one clip, in one batch,
    with their bytes where the decoder needs them (connector delivery)."""
    vision = VisionModel(tiny_checkpoint(request.param), settings=BUILDERS[request.param].engine_args)
    vision.load_encoder()
    assert ("video" in vision.modalities) == (request.param in TAKES_VIDEO), vision.modalities
    items = [(png_bytes(n), vision.load_image(png_bytes(n)), "image") for n in ("wide", "tall")]
    if "video" in vision.modalities:
        items.append((clip_bytes(), vision.load_video(clip_bytes()), "video"))
    batch = []
    for data, media, modality in items:
        pixels = vision.preprocess(media, modality)
        pixels.source = data
        batch.append(pixels)
    features = vision.encode(batch)
    assert [f.meta.get("modality", "image") for f in features] == [m for _, _, m in items]
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
        form = _form(vision, f)
        for name in form.metadata_fields if form.delivery == EMBEDDINGS else ():
            meta = f.tensors[name]
            # (Values of float metadata, e.g. Qwen3-VL's frame timestamps, size nothing: any will do.)
            values = [] if meta.is_floating_point() else [meta * 2 + 1]
            for bad in (*values, meta[:-1], meta.to(torch.int32 if meta.dtype != torch.int32 else torch.int64)):
                assert vision.feature_problem(_with(f, **{name: bad})), (name, bad)
            checked += 1
    # (Every form through the connector, e.g. MiniCPM-V 4.7's: its features carry no metadata.)
    assert checked or not any(f.metadata_fields for f in vision.forms.values() if f.delivery == EMBEDDINGS)


def test_decoder_and_encoder_agree_on_the_fingerprint(encoded, tiny_checkpoint):
    vision, _ = encoded
    decoder = VisionModel(vision.checkpoint, settings=vision.settings)
    assert decoder.expected_fingerprint() == vision.fingerprint()
    assert decoder.model is None  # the tower is dropped again
    assert decoder.forms == vision.forms and decoder.modalities == vision.modalities
    other = "bfloat16" if vision.dtype != torch.bfloat16 else "float32"
    other_dtype = VisionModel(vision.checkpoint, other, settings=vision.settings)
    assert other_dtype.expected_fingerprint() != vision.fingerprint()


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
    tuned = VisionModel(str(copy), dtype)
    assert tuned.expected_fingerprint() != original.fingerprint()
    assert tuned.processing_id() == original.processing_id()  # its pixels are the original's


def test_a_preprocessing_setting_changes_what_pixels_are_stamped_with(tiny_checkpoint):
    """The encoder refuses pixels of another Preprocess setting (a rolling update of
    mm_processor_kwargs), by the processing id each PixelInputs carries."""
    checkpoint = tiny_checkpoint("qwen2_vl")
    plain, fewer = VisionModel(checkpoint), VisionModel(checkpoint, mm_processor_kwargs={"max_pixels": 3136})
    assert plain.processing_id() != fewer.processing_id()
    image = plain.load_image(png_bytes("wide"))
    stamped = plain.preprocess(image), fewer.preprocess(image)
    assert [p.processed_with for p in stamped] == [plain.processing_id(), fewer.processing_id()]
    assert stamped[0].num_tokens > stamped[1].num_tokens


def test_a_mistral_format_image_setting_changes_what_pixels_are_stamped_with(tmp_path, tiny_checkpoint):
    """Mistral's format keeps its image settings in the Tekken tokenizer (tekken.json's `image`):
    another max_image_size is another Preprocess, with fewer tokens an image."""
    import shutil

    settings = BUILDERS["pixtral"].engine_args
    copy = tmp_path / "smaller"
    shutil.copytree(tiny_checkpoint("pixtral"), copy)
    tekken = json.loads((copy / "tekken.json").read_text())
    tekken["image"]["max_image_size"] //= 2
    (copy / "tekken.json").write_text(json.dumps(tekken))
    plain, smaller = (
        VisionModel(tiny_checkpoint("pixtral"), settings=settings),
        VisionModel(str(copy), settings=settings),
    )
    assert plain.processing_id() != smaller.processing_id()
    image = plain.load_image(png_bytes("square"))
    assert plain.preprocess(image).num_tokens > smaller.preprocess(image).num_tokens


def test_features_reach_the_decoder_as_embeddings_where_vllm_takes_them(encoded, tiny_checkpoint):
    """Images: the connector for the families whose vLLM source has no image-embedding input
    (scripts/family_table.py reads it); where it has one, the connector only when vLLM refuses
    the model's own features of two images of other sizes as one prompt's embeddings (PaliGemma:
    any; LLaVA-NeXT, InternVL, LLaVA-OneVision, Phi-3-Vision: one image is taken, two of other token counts
    not, their input being one tensor for all). Videos: the connector for the families listed.
    Connector features carry the item's bytes for the engine's processor, embeddings never."""
    vision, features = encoded
    family = next(f for f in FAMILIES if tiny_checkpoint(f) == vision.checkpoint)
    if not takes_image_embeddings(vision.checkpoint, vision.vllm_config.model_config.architecture):
        assert vision.forms["image"].delivery == CONNECTOR, family
    elif vision.forms["image"].delivery == CONNECTOR:
        model = VisionModel(vision.checkpoint, connector=True, settings=vision.settings)
        model.load_encoder()  # (its forms say connector: the check below does not depend on them)
        one, other = (
            model.encode([model.preprocess(model.load_image(data))])[0]
            for data in (sample_image_bytes(), sample_image_bytes(160, 40))
        )
        problem = model._embedding_input_problem([one, other][: model.limits["image"]], "image")
        assert problem is not None, family
        if model._embedding_input_problem([one], "image") is None:
            assert one.num_tokens != other.num_tokens and "inconsistent shapes" in problem, (family, problem)
    if "video" in vision.modalities:
        assert vision.forms["video"].delivery == (CONNECTOR if family in VIDEO_BY_CONNECTOR else EMBEDDINGS)
    for f in features:
        connector = _form(vision, f).delivery == CONNECTOR
        assert (SOURCE in f.tensors) == connector, (family, f.modality)
        if connector:
            assert vision.feature_problem(Features({k: v for k, v in f.tensors.items() if k != SOURCE}, f.meta))


def test_connector_delivery_can_be_forced_and_decodes_the_bytes(tiny_checkpoint):
    """decoder_features: connector, for a family vLLM takes embeddings for: the decoder input is
    the image vLLM's own loader decodes from the bytes the features carry."""
    vision = VisionModel(tiny_checkpoint("llava"), connector=True)
    vision.load_encoder()
    assert vision.forms["image"].delivery == CONNECTOR
    pixels = vision.preprocess(vision.load_image(png_bytes("wide")))
    pixels.source = png_bytes("wide")
    (features,) = vision.encode([pixels])
    assert vision.feature_problem(features) is None
    (image,) = vision.source_items([features])
    assert image.size == vision.load_image(png_bytes("wide")).size and image.mode == "RGB"
    assert vision.sample_features is not None and SOURCE in vision.sample_features.tensors
