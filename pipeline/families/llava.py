"""LLaVA-1.5: CLIP vision tower, features from layer -2 without CLS, MLP projector."""

from __future__ import annotations

import functools
import re

import torch
from PIL import Image

from cache_service.codec import Features
from pipeline.families.base import FamilyAdapter, PixelInputs, tensor_problem, token_count_problem

_LAYER = re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.")


def feature_layer_count(llava_config) -> int:
    """Encoder layers up to and including `vision_feature_layer` (hidden state 0 is the embeddings)."""
    layer = llava_config.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError(f"LLaVA adapter supports one vision_feature_layer, got {layer!r}")
    total = llava_config.vision_config.num_hidden_layers
    if not -(total + 1) <= layer <= total:
        raise ValueError(f"vision_feature_layer {layer} is outside the tower's {total} layers")
    return layer % (total + 1)


class LlavaVision(torch.nn.Module):
    def __init__(self, config: dict):
        from transformers import CLIPVisionConfig, CLIPVisionModel, LlavaConfig
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        super().__init__()
        llava_config = LlavaConfig(**config)
        self.select_strategy = llava_config.vision_feature_select_strategy
        vision_config = llava_config.vision_config
        if not isinstance(vision_config, CLIPVisionConfig):
            raise ValueError(f"LLaVA adapter supports CLIP vision towers, got {type(vision_config).__name__}")
        # Build the tower only up to the feature layer, as vLLM does: LLaVA-1.5 reads layer -2,
        # so the last layer would be computed for nothing (1/24 of CLIP-L, 1/12 of the bench tower).
        vision_config.num_hidden_layers = feature_layer_count(llava_config)
        self.vision_tower = CLIPVisionModel(vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(llava_config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.vision_tower(pixel_values).last_hidden_state  # the feature layer's output
        if self.select_strategy == "default":
            hidden = hidden[:, 1:]  # drop CLS
        return self.multi_modal_projector(hidden)


class LlavaAdapter(FamilyAdapter):
    model_types = ("llava",)

    def preprocess(self, image: Image.Image) -> PixelInputs:
        pixel_values = self.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        side_h, side_w = pixel_values.shape[-2:]
        patch = self.config["vision_config"]["patch_size"]
        num_tokens = (side_h // patch) * (side_w // patch)
        if self.config.get("vision_feature_select_strategy", "default") == "full":
            num_tokens += 1
        return PixelInputs({"pixel_values": pixel_values[0]}, num_tokens)

    # Hub layout is `vision_tower.vision_model.*`; transformers 5's CLIPVisionModel has no `vision_model`.
    vision_weight_prefixes = {
        "model.vision_tower.vision_model.": "vision_tower.", "vision_tower.vision_model.": "vision_tower.",
        "model.vision_tower.": "vision_tower.", "vision_tower.": "vision_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "multi_modal_projector.": "multi_modal_projector.",
    }

    def build_vision(self) -> torch.nn.Module:
        return LlavaVision(self.config)

    def unused_vision_weight(self, name: str) -> bool:
        # Layers past the feature layer are not built (see LlavaVision).
        match = _LAYER.match(name)
        return match is not None and int(match.group(1)) >= self.vision_layers_built

    @functools.cached_property
    def vision_layers_built(self) -> int:
        from transformers import LlavaConfig

        return feature_layer_count(LlavaConfig(**self.config))

    @torch.inference_mode()
    def encode(self, batch: list[PixelInputs]) -> list[Features]:
        param = next(self.vision.parameters())
        pixels = torch.stack([p.tensors["pixel_values"] for p in batch]).to(param.device, param.dtype)
        out = self.vision(pixels)
        return [Features({"image_embeds": f}, {"num_tokens": f.shape[0]}) for f in out]

    def vllm_image_data(self, features: list[Features]):
        # LLaVA-1.5 gives every image the same number of tokens: one [n, tokens, hidden] tensor.
        return torch.stack([f.tensors["image_embeds"] for f in features])

    def feature_problem(self, features: Features, dtype: torch.dtype) -> str | None:
        # Every image is resized to one square: a fixed token count, projected to the LM's width.
        vision = self.config["vision_config"]
        tokens = (vision["image_size"] // vision["patch_size"]) ** 2
        if self.config.get("vision_feature_select_strategy", "default") == "full":
            tokens += 1
        if set(features.tensors) != {"image_embeds"}:
            return f"tensors {sorted(features.tensors)}, expected ['image_embeds']"
        hidden = self.config["text_config"]["hidden_size"]
        return (tensor_problem(features, "image_embeds", dtype, [tokens, hidden])
                or token_count_problem(features, tokens))
