"""Built-in LLaVA-NeXT (LLaVA-1.6): CLIP vision tower run on a base view plus tiles picked
from `image_grid_pinpoints` (AnyRes), MLP projector, row-end newline embeddings, Llama
language model."""

from __future__ import annotations

from pathlib import Path

from pipeline.model.builtin.common import (
    CLIP_MEAN_STD,
    INIT_RANGE,
    Spec,
    hub_vision_tower_name,
    rename_weights,
    save,
)
from pipeline.model.builtin.llava import clip_llama, llava_processor


def build(spec: Spec, out: Path) -> None:
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
    )

    tokenizer, ids, vision, text = clip_llama(spec)
    side = spec.image_size  # tiles are side×side; an image is covered by up to 2×2 of them
    pinpoints = [[side, side], [side, 2 * side], [2 * side, side], [2 * side, 2 * side]]
    config = LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["<image>"],
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=pinpoints,
        image_seq_length=(side // spec.patch_size) ** 2,
        pad_token_id=ids["<pad>"],
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
    )
    config.initializer_range = INIT_RANGE
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": side},
        crop_size={"height": side, "width": side},
        image_grid_pinpoints=pinpoints,
        do_center_crop=True,
        do_resize=True,
        do_normalize=True,
        do_convert_rgb=True,
        do_pad=True,
        **CLIP_MEAN_STD,
    )
    processor = llava_processor(LlavaNextProcessor, image_processor, tokenizer, spec)
    model = LlavaNextForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)
    rename_weights(out, hub_vision_tower_name)  # same CLIP layout fix as LLaVA-1.5
