"""The built-in checkpoints: deterministic, hub layout, loadable by transformers;
and vLLM's encoder-only model batches them. (That Iris's features equal vLLM's own
encoder output is tests/test_families.py.)"""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from pipeline.models.builtin import FAMILIES, build_checkpoint
from pipeline.models.source import resolve_model
from pipeline.vision_model import VisionModel
from tests.support.images import SIZES, make_image


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
    if family in ("llava", "llava_next", "gemma3"):  # the hub's CLIP/SigLIP layout, which vLLM's loader expects
        assert any(k.startswith("vision_tower.vision_model.") for k in keys)
        assert not any(k.startswith("vision_tower.encoder.") for k in keys)


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
    image_token = getattr(model.config, "image_token_id", None) or model.config.image_token_index
    assert int((inputs["input_ids"] == image_token).sum()) > 1


def test_batched_encode_equals_single(tiny_checkpoint):
    vision = VisionModel(tiny_checkpoint("qwen2_vl"))
    vision.load_encoder()
    pixels = [vision.preprocess(make_image(*s)) for s in SIZES.values()]
    batched = vision.encode(pixels)
    for p, b in zip(pixels, batched):
        torch.testing.assert_close(b.tensors["image_embeds"], vision.encode([p])[0].tensors["image_embeds"],
                                   rtol=0, atol=1e-4)
    assert len({p.num_tokens for p in pixels}) == 3  # sizes differ: dynamic resolution works


def test_bench_checkpoints_build_and_load(tmp_path):
    """The bench sizes have a realistic vision tower (ViT-B: CLIP ViT-B/16 at 224 px for LLaVA)."""
    for family in ("llava", "qwen2_vl", "qwen2_5_vl"):
        folder = build_checkpoint(family, "bench", tmp_path / family)
        vision_config = json.loads((folder / "config.json").read_text())["vision_config"]
        assert vision_config.get("embed_dim", vision_config["hidden_size"]) == 768  # ViT-B: 768 wide, 12 deep
        assert vision_config.get("depth", vision_config.get("num_hidden_layers")) == 12
        vision = VisionModel(str(folder))
        vision.load_encoder()
        features = vision.encode([vision.preprocess(make_image(224, 224, 0))])[0]
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
