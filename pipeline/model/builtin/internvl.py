"""Built-in InternVL3 (Hugging Face format): InternViT tower, pixel-shuffle MLP projector,
Qwen2 language model; images are cut into tiles of the tower's input size plus a thumbnail."""

from __future__ import annotations

from pathlib import Path

from pipeline.model.builtin.common import (
    INIT_RANGE,
    Spec,
    byte_level_tokenizer,
    chat_template,
    save,
)

MAX_TILES = 2  # tiles an image is cut into at most (plus a thumbnail when more than one)
DOWNSAMPLE_RATIO = 0.5

NL = "{{ '\\n' }}"
INTERNVL_CHAT_TEMPLATE = chat_template(
    user_prefix="<|im_start|>user" + NL,
    user_suffix="<|im_end|>" + NL,
    assistant_prefix="<|im_start|>assistant" + NL,
    assistant_suffix="<|im_end|>" + NL,
    image="<IMG_CONTEXT>" + NL,
    generation_prompt="<|im_start|>assistant" + NL,
    system_prefix="<|im_start|>system" + NL,
    system_suffix="<|im_end|>" + NL,
    video="<video>" + NL,
)

INTERNVL_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
# InternVLProcessor reads these tokenizer attributes (as InternVL3-hf's tokenizer_config.json sets them).
INTERNVL_TOKEN_ROLES = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}


def build(spec: Spec, out: Path) -> None:
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVideoProcessor,
    )

    tokenizer = byte_level_tokenizer(
        INTERNVL_SPECIAL, bos=None, eos="<|im_end|>", pad="<|endoftext|>", extra_special_tokens=INTERNVL_TOKEN_ROLES
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in INTERNVL_SPECIAL}
    text = dict(
        model_type="qwen2",
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=4 * spec.text_hidden,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        hidden_size=spec.vision_hidden,
        intermediate_size=4 * spec.vision_hidden,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=[spec.image_size] * 2,
        patch_size=[spec.patch_size] * 2,
        attention_bias=True,
        norm_type="layer_norm",
        use_qk_norm=False,
        use_mean_pooling=True,
        layer_scale_init_value=1.0,
        initializer_range=INIT_RANGE,
    )
    tokens_per_tile = int((spec.image_size // spec.patch_size) ** 2 * DOWNSAMPLE_RATIO**2)
    config = InternVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=tokens_per_tile,
        downsample_ratio=DOWNSAMPLE_RATIO,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
        pad_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
    )
    config.initializer_range = INIT_RANGE
    size = {"height": spec.image_size, "width": spec.image_size}
    # crop_to_patches on the image processor too: vLLM counts tiles with its settings, while
    # InternVLProcessor crops by default.
    image_processor = GotOcr2ImageProcessor(
        size=size,
        crop_to_patches=True,
        min_patches=1,
        max_patches=MAX_TILES,
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_convert_rgb=True,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    )
    video_processor = InternVLVideoProcessor(
        size=size, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]
    )
    processor = InternVLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        image_seq_length=tokens_per_tile,
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )
    model = InternVLForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)
