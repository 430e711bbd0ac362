"""Built-in MiniCPM-V 4.6: SigLIP-style NaViT vision tower with a window-attention merger
after an inner layer, a 2×2 downsampling MLP merger, and a Qwen3.5 hybrid language model
(Gated DeltaNet linear-attention layers plus gated full-attention layers).

Images are resized to about `image_size`² pixels (the source view); larger ones are also
cut into a grid of slices of about that size. Each view becomes (side/patch)²/16 tokens:
`<image_id>i</image_id><image>` + <|image_pad|>×n + `</image>`, then
`<slice>` + <|image_pad|>×n + `</slice>` per slice, rows joined by newlines.
vLLM takes precomputed embeddings as {"image_embeds": (1, tokens, text_hidden),
"image_sizes": (1, 2) as [width, height] of the original image}.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.model.builtin.common import (
    INIT_RANGE,
    Spec,
    byte_level_tokenizer,
    chat_template,
    save,
    token_ids,
)
from pipeline.model.builtin.qwen3_5 import hybrid_text_config

MAX_SLICES = 4

MINICPMV4_6_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<image>",
    "</image>",
    "<slice>",
    "</slice>",
    "<image_id>",
    "</image_id>",
]

# tokenizer attributes MiniCPMV4_6Processor and vLLM read (tokenizer.image_token, ...)
MINICPMV4_6_TOKEN_ATTRS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}

MINICPMV4_6_CHAT_TEMPLATE = chat_template(
    user_prefix="<|im_start|>user\n",
    user_suffix="<|im_end|>\n",
    assistant_prefix="<|im_start|>assistant\n",
    assistant_suffix="<|im_end|>\n",
    image="<|image_pad|>\n",
    generation_prompt="<|im_start|>assistant\n",
    system_prefix="<|im_start|>system\n",
    system_suffix="<|im_end|>\n",
)


def build(spec: Spec, out: Path) -> None:
    from transformers import MiniCPMV4_6Config, MiniCPMV4_6ForConditionalGeneration, MiniCPMV4_6Processor

    tokenizer = minicpmv_tokenizer()
    ids = token_ids(tokenizer, MINICPMV4_6_SPECIAL)
    config = MiniCPMV4_6Config(**config_fields(spec, tokenizer, ids), drop_vision_last_layer=False)
    finish_config(config, ids)
    processor = minicpmv_processor(MiniCPMV4_6Processor, spec, tokenizer)
    model = MiniCPMV4_6ForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)


def minicpmv_tokenizer():
    """The byte-level tokenizer with MiniCPM-V 4.x's special tokens and the attributes its processors read."""
    return byte_level_tokenizer(
        MINICPMV4_6_SPECIAL,
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        extra_special_tokens=MINICPMV4_6_TOKEN_ATTRS,
    )


def config_fields(spec: Spec, tokenizer, ids: dict[str, int]) -> dict:
    """The fields MiniCPM-V 4.6's and 4.7's configs share: a Qwen3.5 hybrid language model, the
    SigLIP-style tower with its window-attention merger after an inner layer, 16x downsampling."""
    text = {"model_type": "qwen3_5_text", **hybrid_text_config(spec, tokenizer)}
    vision = dict(
        hidden_size=spec.vision_hidden,
        intermediate_size=4 * spec.vision_hidden,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        initializer_range=INIT_RANGE,
    )
    return dict(
        text_config=text,
        vision_config=vision,
        insert_layer_id=spec.vision_layers // 2 - 1,
        image_size=spec.image_size,
        downsample_mode="16x",
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        tie_word_embeddings=False,
    )


def finish_config(config, ids: dict[str, int]) -> None:
    config.bos_token_id, config.eos_token_id = None, ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    config.initializer_range = INIT_RANGE


def minicpmv_processor(processor_class, spec: Spec, tokenizer):
    """`processor_class` (MiniCPM-V 4.6's or 4.7's processor) with 4.6's image and video processors,
    which 4.7 uses too: views of about `image_size`² pixels, up to MAX_SLICES slices."""
    from transformers import MiniCPMV4_6ImageProcessor, MiniCPMV4_6VideoProcessor

    common = dict(
        max_slice_nums=MAX_SLICES,
        scale_resolution=spec.image_size,
        patch_size=spec.patch_size,
        slice_mode=True,
        downsample_mode="16x",
        use_image_id=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return processor_class(
        image_processor=MiniCPMV4_6ImageProcessor(**common),
        video_processor=MiniCPMV4_6VideoProcessor(**common, max_num_frames=4),
        tokenizer=tokenizer,
        chat_template=MINICPMV4_6_CHAT_TEMPLATE,
    )
