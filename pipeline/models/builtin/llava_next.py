"""Built-in LLaVA-NeXT (LLaVA-1.6): CLIP vision tower run on a base view plus tiles picked
from `image_grid_pinpoints` (AnyRes), MLP projector, row-end newline embeddings, Llama
language model."""

from __future__ import annotations

from pathlib import Path

from pipeline.models.builtin.common import (INIT_RANGE, Spec, byte_level_tokenizer, hub_vision_tower_name,
                                            rename_weights, save)
from pipeline.models.builtin.llava import LLAVA_CHAT_TEMPLATE, LLAVA_SPECIAL

SPECS = {
    "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 56, 14, "float32"),
}


def build(spec: Spec, out: Path) -> None:
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration,
                              LlavaNextImageProcessor, LlavaNextProcessor)

    tokenizer = byte_level_tokenizer(LLAVA_SPECIAL, bos="<s>", eos="</s>", pad="<pad>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in LLAVA_SPECIAL}
    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden, intermediate_size=4 * spec.vision_hidden,
        num_hidden_layers=spec.vision_layers, num_attention_heads=spec.vision_heads,
        image_size=spec.image_size, patch_size=spec.patch_size, projection_dim=spec.vision_hidden,
        initializer_range=INIT_RANGE,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.text_hidden, intermediate_size=4 * spec.text_hidden,
        num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads, max_position_embeddings=4096,
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
        initializer_range=INIT_RANGE, tie_word_embeddings=False,
    )
    side = spec.image_size  # tiles are side×side; an image is covered by up to 2×2 of them
    pinpoints = [[side, side], [side, 2 * side], [2 * side, side], [2 * side, 2 * side]]
    config = LlavaNextConfig(
        vision_config=vision, text_config=text, image_token_index=ids["<image>"],
        projector_hidden_act="gelu", vision_feature_layer=-2, vision_feature_select_strategy="default",
        image_grid_pinpoints=pinpoints, image_seq_length=(side // spec.patch_size) ** 2,
        pad_token_id=ids["<pad>"], bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
    )
    config.initializer_range = INIT_RANGE
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side},
        image_grid_pinpoints=pinpoints, do_center_crop=True, do_resize=True, do_normalize=True,
        do_convert_rgb=True, do_pad=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=spec.patch_size,
        vision_feature_select_strategy="default", chat_template=LLAVA_CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )
    model = LlavaNextForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)
    rename_weights(out, hub_vision_tower_name)  # same CLIP layout fix as LLaVA-1.5
