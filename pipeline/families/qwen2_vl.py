"""Qwen2-VL (and Qwen2.5-VL): dynamic-resolution ViT whose merger is the projector;
vLLM takes the flat embeddings together with each image's (t, h, w) patch grid."""

from __future__ import annotations

import torch
from PIL import Image

from cache_service.codec import Features
from pipeline.families.base import FamilyAdapter, PixelInputs, tensor_problem, token_count_problem


class Qwen2VLAdapter(FamilyAdapter):
    model_types = ("qwen2_vl", "qwen2_5_vl")

    @property
    def merge_size(self) -> int:
        return self.config["vision_config"].get("spatial_merge_size", 2)

    def preprocess(self, image: Image.Image) -> PixelInputs:
        out = self.image_processor(images=[image], return_tensors="pt")
        grid = out["image_grid_thw"]  # [1, 3]
        num_tokens = int(grid.prod()) // (self.merge_size ** 2)
        return PixelInputs({"pixel_values": out["pixel_values"], "image_grid_thw": grid}, num_tokens)

    vision_weight_prefixes = {"model.visual.": "", "visual.": ""}

    def build_vision(self) -> torch.nn.Module:
        if self.config["model_type"] == "qwen2_5_vl":
            from transformers import Qwen2_5_VLConfig
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
                Qwen2_5_VisionTransformerPretrainedModel as Vision)

            return Vision(Qwen2_5_VLConfig(**self.config).vision_config)
        from transformers import Qwen2VLConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as Vision

        return Vision(Qwen2VLConfig(**self.config).vision_config)

    @torch.inference_mode()
    def encode(self, batch: list[PixelInputs]) -> list[Features]:
        param = next(self.vision.parameters())
        pixels = torch.cat([p.tensors["pixel_values"] for p in batch]).to(param.device, param.dtype)
        grids = torch.cat([p.tensors["image_grid_thw"] for p in batch]).to(param.device)
        out = self.vision(pixels, grid_thw=grids)
        embeds = out.pooler_output if hasattr(out, "pooler_output") else out
        sizes = [p.num_tokens for p in batch]
        return [
            Features({"image_embeds": e, "image_grid_thw": p.tensors["image_grid_thw"]}, {"num_tokens": e.shape[0]})
            for e, p in zip(torch.split(embeds, sizes), batch)
        ]

    def vllm_image_data(self, features: list[Features]):
        return {
            "image_embeds": torch.cat([f.tensors["image_embeds"] for f in features]),
            "image_grid_thw": torch.cat([f.tensors["image_grid_thw"] for f in features]),
        }

    def feature_problem(self, features: Features, dtype: torch.dtype) -> str | None:
        # Dynamic resolution: the token count follows from the image's (t, h, w) patch grid.
        if set(features.tensors) != {"image_embeds", "image_grid_thw"}:
            return f"tensors {sorted(features.tensors)}, expected ['image_embeds', 'image_grid_thw']"
        problem = tensor_problem(features, "image_grid_thw", torch.int64, [1, 3])
        if problem:
            return problem
        t, h, w = (int(x) for x in features.tensors["image_grid_thw"][0])
        merge = self.merge_size
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            return f"image_grid_thw {[t, h, w]} is not a grid of {merge}x{merge} merged patches"
        tokens = t * h * w // merge**2
        vision = self.config["vision_config"]
        hidden = vision.get("out_hidden_size") or vision["hidden_size"]  # merger output (2.5-VL / 2-VL)
        return (tensor_problem(features, "image_embeds", dtype, [tokens, hidden])
                or token_count_problem(features, tokens))
