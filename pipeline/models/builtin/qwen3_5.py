"""Built-in Qwen3.5: the Qwen3-VL dynamic-resolution ViT (patch 16, learned + rotary
positions, merger as projector; no DeepStack taps) in front of a Qwen3.5 hybrid language
model (Gated DeltaNet linear-attention layers plus gated full-attention layers) with
interleaved multimodal RoPE over a partial rotary dimension.

Prompts and processing are Qwen3-VL's: <|vision_start|> + <|image_pad|>×n + <|vision_end|>,
n = (h/32)·(w/32) for the resized image. vLLM takes precomputed embeddings as
{"image_embeds": (n, text_hidden), "image_grid_thw": (1, 3)}.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.models.builtin.common import INIT_RANGE, Spec, byte_level_tokenizer, save, token_ids
from pipeline.models.builtin.qwen2_vl import QWEN2_VL_CHAT_TEMPLATE, QWEN2_VL_SPECIAL

SPECS = {
    # bfloat16: vLLM's CPU Gated DeltaNet kernel takes BF16 only (float32 fails at the first step).
    "tiny": Spec(128, 2, 2, 1, 64, 2, 4, 112, 16, "bfloat16"),
}


def build(spec: Spec, out: Path) -> None:
    from transformers import (Qwen2VLImageProcessor, Qwen3_5Config, Qwen3_5ForConditionalGeneration,
                              Qwen3VLProcessor, Qwen3VLVideoProcessor)

    tokenizer = byte_level_tokenizer(QWEN2_VL_SPECIAL, bos=None, eos="<|im_end|>", pad="<|endoftext|>")
    ids = token_ids(tokenizer, QWEN2_VL_SPECIAL)
    head_dim = spec.text_hidden // spec.text_heads
    half = head_dim // 8  # half the rotary dims (partial_rotary_factor 0.25)
    text = dict(
        vocab_size=len(tokenizer), hidden_size=spec.text_hidden, intermediate_size=4 * spec.text_hidden,
        num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads, head_dim=head_dim,
        # full attention first (the hub's puts it last): a random Gated DeltaNet layer decays the
        # early image tokens away before the last position, so greedy output ignored the image
        layer_types=["full_attention"] + ["linear_attention"] * (spec.text_layers - 1),
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,  # CPU GDN kernel: 128
        linear_num_key_heads=1, linear_num_value_heads=2, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
                         "mrope_interleaved": True},
        initializer_range=INIT_RANGE, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )
    grid = spec.image_size // spec.patch_size  # learned position grid, interpolated to each image
    vision = dict(
        depth=spec.vision_layers, hidden_size=spec.vision_hidden, intermediate_size=4 * spec.vision_hidden,
        num_heads=spec.vision_heads, hidden_act="gelu_pytorch_tanh", in_channels=3,
        patch_size=spec.patch_size, spatial_merge_size=2, temporal_patch_size=2,
        out_hidden_size=spec.text_hidden, num_position_embeddings=grid * grid, initializer_range=INIT_RANGE,
    )
    config = Qwen3_5Config(
        text_config=text, vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.bos_token_id, config.eos_token_id = None, ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    config.initializer_range = INIT_RANGE
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
    processor = Qwen3VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )
    model = Qwen3_5ForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)
