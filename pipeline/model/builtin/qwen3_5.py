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

from pipeline.model.builtin.common import (
    INIT_RANGE,
    Spec,
    byte_level_tokenizer,
    save,
    token_ids,
)
from pipeline.model.builtin.qwen2_vl import QWEN2_VL_SPECIAL
from pipeline.model.builtin.qwen3_vl import qwen3_vl_processor, vision_config


def build(spec: Spec, out: Path) -> None:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    build_hybrid(spec, out, Qwen3_5Config, Qwen3_5ForConditionalGeneration)


def build_hybrid(spec: Spec, out: Path, config_class, model_class, text_config=lambda text: text) -> None:
    """A Qwen3.5 of `config_class` / `model_class`, its language model's config changed by
    `text_config` (Qwen3.5-MoE: sparse MLPs)."""
    tokenizer = byte_level_tokenizer(QWEN2_VL_SPECIAL, bos=None, eos="<|im_end|>", pad="<|endoftext|>")
    ids = token_ids(tokenizer, QWEN2_VL_SPECIAL)
    config = config_class(
        text_config=text_config(hybrid_text_config(spec, tokenizer)),
        vision_config=vision_config(spec, deepstack=False),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.bos_token_id, config.eos_token_id = None, ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    config.initializer_range = INIT_RANGE
    processor = qwen3_vl_processor(spec, tokenizer)
    model = model_class(config)
    save(model, processor, tokenizer, spec, out)


def hybrid_text_config(spec: Spec, tokenizer) -> dict:
    """Qwen3.5's hybrid language model (also MiniCPM-V 4.6's): Gated DeltaNet linear-attention
    layers plus gated full attention, interleaved multimodal RoPE over a quarter of the head."""
    ids = token_ids(tokenizer, ["<|im_end|>", "<|endoftext|>"])
    head_dim = spec.text_hidden // spec.text_heads
    half = head_dim // 8  # half the rotary dims (partial_rotary_factor 0.25)
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=4 * spec.text_hidden,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        head_dim=head_dim,
        # full attention first (the hub's puts it last): a random Gated DeltaNet layer decays the
        # early image tokens away before the last position, so greedy output ignored the image
        layer_types=["full_attention"] + ["linear_attention"] * (spec.text_layers - 1),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,  # CPU GDN kernel: 128
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
            "mrope_interleaved": True,
        },
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
