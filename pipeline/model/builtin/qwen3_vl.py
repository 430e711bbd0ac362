"""Built-in Qwen3-VL: dynamic-resolution ViT (patch 16, learned + rotary positions) whose
merger is the projector, with DeepStack taps that add features of inner ViT layers to the
first language-model layers; Qwen3 language model with interleaved multimodal RoPE."""

from __future__ import annotations

from pathlib import Path

from pipeline.model.builtin.common import (
    INIT_RANGE,
    Spec,
    byte_level_tokenizer,
    qwen_vision_token_ids,
    save,
)
from pipeline.model.builtin.qwen2_vl import QWEN2_VL_CHAT_TEMPLATE, QWEN2_VL_SPECIAL


def build(spec: Spec, out: Path) -> None:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = byte_level_tokenizer(QWEN2_VL_SPECIAL, bos=None, eos="<|im_end|>", pad="<|endoftext|>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_SPECIAL}
    head_dim = spec.text_hidden // spec.text_heads
    half = head_dim // 2
    # t, h, w in Qwen3-VL's 24:20:20 ratio, sums to head_dim/2; interleaved h/w need 3*section <= half
    hw = half * 5 // 16
    mrope_section = [half - 2 * hw, hw, hw]
    text = dict(
        vocab_size=len(tokenizer), hidden_size=spec.text_hidden, intermediate_size=4 * spec.text_hidden,
        num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads, head_dim=head_dim, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                         "mrope_section": mrope_section, "mrope_interleaved": True},
        initializer_range=INIT_RANGE, pad_token_id=ids["<|endoftext|>"],
    )
    vision = vision_config(spec, deepstack=True)
    config = Qwen3VLConfig(
        text_config=text, vision_config=vision,
        **qwen_vision_token_ids(ids),
        tie_word_embeddings=False,
    )
    config.initializer_range = INIT_RANGE
    processor = qwen3_vl_processor(spec, tokenizer)
    model = Qwen3VLForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)


def vision_config(spec: Spec, deepstack: bool) -> dict:
    """The Qwen3-VL ViT (also Qwen3.5's, without DeepStack taps)."""
    grid = spec.image_size // spec.patch_size  # learned position grid, interpolated to each image
    taps = {"deepstack_visual_indexes": list(range(spec.vision_layers))} if deepstack else {}
    return dict(
        depth=spec.vision_layers, hidden_size=spec.vision_hidden, intermediate_size=4 * spec.vision_hidden,
        num_heads=spec.vision_heads, hidden_act="gelu_pytorch_tanh", in_channels=3,
        patch_size=spec.patch_size, spatial_merge_size=2, temporal_patch_size=2,
        out_hidden_size=spec.text_hidden, num_position_embeddings=grid * grid, **taps,
        initializer_range=INIT_RANGE,
    )


def qwen3_vl_processor(spec: Spec, tokenizer):
    """Qwen3-VL's processor (also Qwen3.5's): images up to image_size² pixels, mean and std 0.5."""
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    unit = spec.patch_size * 2  # one merged visual token covers unit×unit pixels
    mean_std = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    image_processor = Qwen2VLImageProcessor(
        min_pixels=unit * unit * 4, max_pixels=spec.image_size * spec.image_size,
        patch_size=spec.patch_size, merge_size=2, temporal_patch_size=2, **mean_std,
    )
    video_processor = Qwen3VLVideoProcessor(
        size={"shortest_edge": unit * unit * 4, "longest_edge": spec.image_size * spec.image_size},
        patch_size=spec.patch_size, merge_size=2, temporal_patch_size=2, cap_pixels_per_frame=True, **mean_std,
    )
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                            chat_template=QWEN2_VL_CHAT_TEMPLATE)
