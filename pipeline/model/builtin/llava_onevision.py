"""Built-in LLaVA-OneVision: SigLIP tower (no CLS token, last layer, no post-norm) run on a base
view plus tiles picked from `image_grid_pinpoints` (AnyRes, here at most 2×2 tiles), MLP
projector, row-end newline embeddings, Qwen2 language model. Videos: each frame at the tile
size, 2×2-pooled, one newline after the last frame.

An image of side×side tiles takes (side/patch)² base tokens plus the unpadded tile grid and
one newline per grid row: 16 + 4·4 + 4 = 36 tokens for the tiny spec's square image, up to
16 + 8·8 + 8 = 88 for a 2×2 grid."""

from __future__ import annotations

from pathlib import Path

from pipeline.model.builtin.common import (
    INIT_RANGE,
    Spec,
    byte_level_tokenizer,
    hub_vision_tower_name,
    rename_weights,
    save,
)

NL = "{{ '\\n' }}"
# Qwen's ChatML with LLaVA-OneVision's "<image>\n" / "<video>\n" before the text of a user turn.
ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}"
    + NL
    + "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>"
    + NL
    + "{% elif part['type'] == 'video' %}<video>"
    + NL
    + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>" + NL + "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant" + NL + "{% endif %}"
)
ONEVISION_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]
SIGLIP_MEAN_STD = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def build(spec: Spec, out: Path) -> None:
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
        Qwen2Config,
        SiglipVisionConfig,
    )

    tokenizer = byte_level_tokenizer(
        ONEVISION_SPECIAL, bos=None, eos="<|im_end|>", pad="<|endoftext|>", vocab_size=spec.vocab_size
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ONEVISION_SPECIAL}
    side = spec.image_size  # tiles are side×side; an image is covered by up to 2×2 of them
    pinpoints = [[side, side], [side, 2 * side], [2 * side, side], [2 * side, 2 * side]]
    tokens_per_tile = (side // spec.patch_size) ** 2
    vision = SiglipVisionConfig(
        hidden_size=spec.vision_hidden,
        intermediate_size=spec.vision_mlp(),
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=side,
        patch_size=spec.patch_size,
        layer_norm_eps=1e-6,
        vision_use_head=False,
        initializer_range=INIT_RANGE,
    )
    text = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_mlp(),
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=4096,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
    )
    config = LlavaOnevisionConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["<image>"],
        video_token_index=ids["<video>"],
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        image_grid_pinpoints=pinpoints,
        vision_aspect_ratio="anyres_max_9",
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
    )
    config.initializer_range = INIT_RANGE
    image_processor = LlavaOnevisionImageProcessor(
        size={"height": side, "width": side},
        image_grid_pinpoints=pinpoints,
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_convert_rgb=True,
        do_pad=True,
        **SIGLIP_MEAN_STD,
    )
    video_processor = LlavaOnevisionVideoProcessor(
        size={"height": side, "width": side},
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_convert_rgb=True,
        **SIGLIP_MEAN_STD,
    )
    processor = LlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        num_image_tokens=tokens_per_tile,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
        chat_template=ONEVISION_CHAT_TEMPLATE,
    )
    model = LlavaOnevisionForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)
    rename_weights(out, hub_vision_tower_name)  # SigLIP: `vision_tower.vision_model.<...>`, as on the hub
