"""Built-in Qwen2-VL and Qwen2.5-VL: dynamic-resolution ViT whose merger is the projector."""

from __future__ import annotations

from pathlib import Path

from pipeline.model.builtin.common import (
    INIT_RANGE,
    Spec,
    byte_level_tokenizer,
    qwen_vision_token_ids,
    save,
)

QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}{{ '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)

QWEN2_VL_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def build(spec: Spec, out: Path, v2_5: bool = False) -> None:
    """Qwen2-VL, or with `v2_5` Qwen2.5-VL (windowed-attention ViT with RMSNorm and SwiGLU)."""
    import transformers
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    prefix = "Qwen2_5_VL" if v2_5 else "Qwen2VL"
    config_cls, model_cls, processor_cls = (
        getattr(transformers, prefix + name) for name in ("Config", "ForConditionalGeneration", "Processor")
    )

    tokenizer = byte_level_tokenizer(
        QWEN2_VL_SPECIAL, bos=None, eos="<|im_end|>", pad="<|endoftext|>", vocab_size=spec.vocab_size
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_SPECIAL}
    head_dim = spec.text_hidden // spec.text_heads
    half = head_dim // 2
    mrope_section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # t, h, w: sums to head_dim/2
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_mlp(),
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=4096,
        rope_scaling={"type": "mrope", "mrope_section": mrope_section},
        rope_theta=1000000.0,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    if v2_5:
        vision = dict(
            depth=spec.vision_layers,
            hidden_size=spec.vision_hidden,
            out_hidden_size=spec.text_hidden,
            intermediate_size=spec.vision_mlp(),
            num_heads=spec.vision_heads,
            hidden_act="silu",
            patch_size=spec.patch_size,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            window_size=2 * 2 * spec.patch_size * 2,
            fullatt_block_indexes=list(spec.vision_full_attention or [spec.vision_layers - 1]),
            tokens_per_second=2,
            initializer_range=INIT_RANGE,
        )
    else:
        vision = dict(
            depth=spec.vision_layers,
            embed_dim=spec.vision_hidden,
            hidden_size=spec.text_hidden,
            num_heads=spec.vision_heads,
            mlp_ratio=4,
            patch_size=spec.patch_size,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            in_chans=3,
            initializer_range=INIT_RANGE,
        )
    config = config_cls(
        text_config=text,
        vision_config=vision,
        **qwen_vision_token_ids(ids),
        tie_word_embeddings=False,
    )
    config.initializer_range = INIT_RANGE
    unit = spec.patch_size * 2  # one merged visual token covers unit×unit pixels
    image_processor = Qwen2VLImageProcessor(
        min_pixels=unit * unit * 4,
        max_pixels=spec.image_size * spec.image_size,
        patch_size=spec.patch_size,
        merge_size=2,
        temporal_patch_size=2,
    )
    video_processor = Qwen2VLVideoProcessor(  # frames as small as the images
        size={"shortest_edge": unit * unit * 4, "longest_edge": spec.image_size * spec.image_size},
        patch_size=spec.patch_size,
        merge_size=2,
        temporal_patch_size=2,
        cap_pixels_per_frame=True,
    )
    processor = processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )
    model = model_cls(config)
    save(model, processor, tokenizer, spec, out)


def build_2_5(spec: Spec, out: Path) -> None:
    build(spec, out, v2_5=True)
