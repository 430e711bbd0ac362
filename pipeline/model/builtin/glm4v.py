"""Built-in GLM-4.1V: dynamic-resolution ViT (2D rotary + interpolated learned positions, conv
downsample, SwiGLU merger as projector), GLM-4 language model (sandwich norms, partial rotary
multimodal RoPE). Images are resized to at most image_size² pixels; each merged 2×2 patch block
is one <|image|> token, framed by <|begin_of_image|> and <|end_of_image|> as in the hub's.

Special tokens and the chat format are GLM-4.1V's ([gMASK]<sop>, <|user|>, <|assistant|>):
vLLM's processor looks up <|image|>, <|begin_of_video|>, <|video|> and <|end_of_video|> by text."""

from __future__ import annotations

from pathlib import Path

from pipeline.model.builtin.common import (
    INIT_RANGE,
    Spec,
    byte_level_tokenizer,
    chat_template,
    save,
)

NL = "{{ '\\n' }}"
GLM4V_CHAT_TEMPLATE = chat_template(
    user_prefix="<|user|>" + NL,
    user_suffix="",
    assistant_prefix="<|assistant|>" + NL,
    assistant_suffix="",
    image="<|begin_of_image|><|image|><|end_of_image|>",
    generation_prompt="<|assistant|>" + NL,
    system_prefix="<|system|>" + NL,
    system_suffix="",
    bos="[gMASK]<sop>",
)

# GLM-4.1V's special tokens, in the hub tokenizer's order.
GLM4V_SPECIAL = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
    "<think>",
    "</think>",
]
TEMPORAL_PATCH = 2  # an image is its frame twice: the processors' pixel budget counts both


def build(spec: Spec, out: Path) -> None:
    from transformers import (
        Glm4vConfig,
        Glm4vForConditionalGeneration,
        Glm4vImageProcessor,
        Glm4vProcessor,
        Glm4vVideoProcessor,
    )

    tokenizer = byte_level_tokenizer(
        GLM4V_SPECIAL, bos=None, eos="<|endoftext|>", pad="<|endoftext|>", vocab_size=spec.vocab_size
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GLM4V_SPECIAL}
    # The hub's generation stops at any of these.
    eos = [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    head_dim = spec.text_hidden // spec.text_heads
    quarter = head_dim // 4  # rotary over half the head: mrope sections sum to head_dim / 4
    hw = quarter * 3 // 8  # GLM-4.1V's 8:12:12 (t, h, w)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_mlp(),
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [quarter - 2 * hw, hw, hw],
        },
        attention_bias=True,  # GLM's q/k/v projections have biases (transformers always builds them)
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        pad_token_id=ids["<|endoftext|>"],
        eos_token_id=eos,
    )
    vision = dict(
        depth=spec.vision_layers,
        hidden_size=spec.vision_hidden,
        num_heads=spec.vision_heads,
        # the merger's MLP width; the blocks' MLPs are out_hidden_size wide, as in transformers and vLLM
        intermediate_size=spec.text_mlp(),
        out_hidden_size=spec.text_hidden,
        hidden_act="silu",
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        spatial_merge_size=2,
        temporal_patch_size=TEMPORAL_PATCH,
        in_channels=3,
        rms_norm_eps=1e-5,
        attention_bias=False,
        initializer_range=INIT_RANGE,
    )
    config = Glm4vConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
    )
    config.initializer_range = INIT_RANGE
    config.pad_token_id, config.eos_token_id = ids["<|endoftext|>"], eos
    # Pixel budgets count TEMPORAL_PATCH frames (vLLM sizes images the same way): at least the
    # processors' default 112², at most image_size² pixels an image.
    max_pixels = TEMPORAL_PATCH * spec.image_size * spec.image_size
    size = {"shortest_edge": 112 * 112, "longest_edge": max_pixels}
    common = dict(
        patch_size=spec.patch_size,
        temporal_patch_size=TEMPORAL_PATCH,
        merge_size=2,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    image_processor = Glm4vImageProcessor(size=size, **common)
    video_size = {"shortest_edge": 112 * 112, "longest_edge": 8 * max_pixels}  # all frames together
    video_processor = Glm4vVideoProcessor(size=video_size, max_image_size={"longest_edge": 8 * max_pixels}, **common)
    processor = Glm4vProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=GLM4V_CHAT_TEMPLATE,
    )
    model = Glm4vForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)
