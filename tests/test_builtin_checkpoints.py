"""The built-in checkpoints: deterministic, hub layout, loadable by transformers,
and Iris's vision-only loading gives the full model's image features."""

import hashlib
from pathlib import Path

import pytest
import torch

from pipeline.families import adapter_for
from pipeline.models.builtin import build_checkpoint
from pipeline.models.source import resolve_model
from tests.support.images import SIZES, make_image

FAMILIES = ["llava", "qwen2_vl", "qwen2_5_vl"]


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_build_is_deterministic(tmp_path, tiny_checkpoint):
    again = build_checkpoint("llava", "tiny", tmp_path / "again")
    assert _digest(again) == _digest(Path(tiny_checkpoint("llava")))


@pytest.mark.parametrize("family", FAMILIES)
def test_hub_layout(family, tiny_checkpoint):
    from safetensors import safe_open

    folder = Path(tiny_checkpoint(family))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "processor_config.json", "model.safetensors"):
        assert (folder / name).is_file(), name
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    if family == "llava":  # llava-hf layout, which vLLM's loader expects
        assert any(k.startswith("vision_tower.vision_model.") for k in keys)
        assert any(k.startswith("multi_modal_projector.") for k in keys)
    else:
        assert any(k.startswith("visual.") for k in keys)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_and_runs(family, tiny_checkpoint):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = tiny_checkpoint(family)
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], images=[make_image(*SIZES["wide"])], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4
    # The processor expanded the single image placeholder into the vision tokens.
    image_token = model.config.image_token_index if family == "llava" else model.config.image_token_id
    assert int((inputs["input_ids"] == image_token).sum()) > 1


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_features_equal_full_model(family, tiny_checkpoint):
    """Loading only the vision tower + projector gives exactly the full model's image features."""
    from transformers import AutoModelForImageTextToText

    folder = tiny_checkpoint(family)
    adapter = adapter_for(folder)
    adapter.load_vision()
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    n_params = sum(p.numel() for p in adapter.vision.parameters())
    assert n_params < sum(p.numel() for p in model.parameters())  # no language model loaded
    if family == "llava":  # the tower stops at the feature layer (-2), as vLLM's does
        built = len(adapter.vision.vision_tower.encoder.layers)
        assert built == model.config.vision_config.num_hidden_layers - 1
    for name, size in SIZES.items():
        image = make_image(*size)
        pixels = adapter.preprocess(image)
        ours = adapter.encode([pixels])[0].tensors["image_embeds"]
        inputs = adapter.image_processor(images=[image], return_tensors="pt")
        with torch.no_grad():
            if family == "llava":
                ref = model.model.get_image_features(inputs["pixel_values"], vision_feature_layer=-2,
                                                     vision_feature_select_strategy="default").pooler_output[0]
            else:
                ref = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output[0]
        assert ours.shape == ref.shape == (pixels.num_tokens, model.config.text_config.hidden_size)
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)


def test_batched_encode_equals_single(tiny_checkpoint):
    adapter = adapter_for(tiny_checkpoint("qwen2_vl"))
    adapter.load_vision()
    pixels = [adapter.preprocess(make_image(*s)) for s in SIZES.values()]
    batched = adapter.encode(pixels)
    for p, b in zip(pixels, batched):
        torch.testing.assert_close(b.tensors["image_embeds"], adapter.encode([p])[0].tensors["image_embeds"],
                                   rtol=0, atol=1e-4)
    assert len({p.num_tokens for p in pixels}) == 3  # sizes differ: dynamic resolution works


def test_bench_checkpoints_build_and_load(tmp_path):
    """The bench sizes have a realistic vision tower (CLIP ViT-B/16 at 224 px)."""
    for family in FAMILIES:
        folder = build_checkpoint(family, "bench", tmp_path / family)
        adapter = adapter_for(str(folder))
        adapter.load_vision()
        vision_params = sum(p.numel() for p in adapter.vision.parameters())
        assert vision_params > 75e6, vision_params  # ViT-B is ~86M; LLaVA builds 11 of its 12 layers
        features = adapter.encode([adapter.preprocess(make_image(224, 224, 0))])[0]
        assert features.tensors["image_embeds"].shape[0] == (196 if family == "llava" else 64)


def test_resolve_model_forms(tmp_path, tiny_checkpoint):
    assert resolve_model("builtin:tiny-llava") == tiny_checkpoint("llava")  # built once, then reused
    assert resolve_model(tiny_checkpoint("llava")) == str(Path(tiny_checkpoint("llava")).resolve())
    assert resolve_model("llava-hf/llava-1.5-7b-hf") == "llava-hf/llava-1.5-7b-hf"  # hub id left to the loaders
    with pytest.raises(ValueError, match="unknown built-in"):
        resolve_model("builtin:huge-llava")
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model("./nope")
