"""Built-in Llama 4 (Scout/Maverick layout, Hugging Face format): Llama 4 vision tower (unfold
patch embedding, CLS token, 2-D rope, pixel-shuffle MLP adapter), linear projector, Llama 4 MoE
language model.

Images are resized to a grid of up to MAX_TILES square tiles of `image_size` (Llama 4's
supported resolutions); with more than one tile a global thumbnail tile follows. Each tile is
(image_size / patch)² patches, pixel-shuffled (ratio 0.5) to a quarter as many <|patch|> tokens.

Unlike real Llama 4 (which picks the smallest canvas an image fits), images go to the largest
canvas (`resize_to_max_canvas`): with MAX_TILES 4 always 2 to 4 tiles plus the global one, never
a single tile. vLLM 0.32's CPU build fails on an encoder batch of one tile: Llama 4's unfold patch
embedding hands `Unfold(...).permute(0, 2, 1)` ([1, patches, 3·p²], last stride = patches) to its
oneDNN GEMM, whose `x.reshape(-1, k)` stays a strided view for one tile ("RuntimeError: Expected
a.stride(-1) == 1") and copies (contiguous) for more. GPUs are not affected.

The language model is Maverick-like: dense and MoE layers alternate (top-1 routed experts beside
a shared expert), RoPE layers use chunked local attention (the chunk far shorter than Llama 4's
8192, so test prompts cross chunks) with QK norm, and the last layer is a NoPE global one.
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

MAX_TILES = 4  # tiles an image is cut into at most (plus a global tile when more than one)
ATTENTION_CHUNK = 128  # chunked local attention span of the RoPE layers (Llama 4: 8192)
PIXEL_SHUFFLE_RATIO = 0.5
NUM_EXPERTS = 4  # routed experts (top-1, as Llama 4) beside the shared expert

NL2 = "{{ '\\n\\n' }}"
LLAMA4_CHAT_TEMPLATE = chat_template(
    user_prefix="<|header_start|>user<|header_end|>" + NL2,
    user_suffix="<|eot|>",
    assistant_prefix="<|header_start|>assistant<|header_end|>" + NL2,
    assistant_suffix="<|eot|>",
    image="<|image|>",
    generation_prompt="<|header_start|>assistant<|header_end|>" + NL2,
    system_prefix="<|header_start|>system<|header_end|>" + NL2,
    system_suffix="<|eot|>",
    bos="<|begin_of_text|>",
)

LLAMA4_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|finetune_right_pad|>",
    "<|header_start|>",
    "<|header_end|>",
    "<|eom|>",
    "<|eot|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|image_start|>",
    "<|image_end|>",
    "<|image|>",
    "<|patch|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
]


def build(spec: Spec, out: Path) -> None:
    from transformers import (
        Llama4Config,
        Llama4ForConditionalGeneration,
        Llama4ImageProcessor,
        Llama4Processor,
    )

    tokenizer = byte_level_tokenizer(
        LLAMA4_SPECIAL, bos="<|begin_of_text|>", eos="<|eot|>", pad="<|finetune_right_pad|>", vocab_size=spec.vocab_size
    )
    ids = token_ids(tokenizer, LLAMA4_SPECIAL)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_mlp(),
        intermediate_size_mlp=spec.text_mlp(),
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        head_dim=spec.text_hidden // spec.text_heads,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=1,
        # Maverick's layout: dense and MoE layers alternate (here: layer 0 dense, layer 1 MoE, ...).
        interleave_moe_layer_step=2,
        # Llama 4's NoPE layers every 4th; with 2 layers, the last one.
        no_rope_layers=[int((i + 1) % 4 != 0 and i != spec.text_layers - 1) for i in range(spec.text_layers)],
        attention_chunk_size=ATTENTION_CHUNK,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=ids["<|eot|>"],
        pad_token_id=ids["<|finetune_right_pad|>"],
    )
    vision = dict(
        hidden_size=spec.vision_hidden,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        # The adapter's MLP takes the pixel-shuffled patches: hidden / ratio² wide.
        intermediate_size=int(spec.vision_hidden / PIXEL_SHUFFLE_RATIO**2),
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        pixel_shuffle_ratio=PIXEL_SHUFFLE_RATIO,
        projector_input_dim=spec.text_hidden,
        projector_output_dim=spec.text_hidden,
        vision_output_dim=spec.text_hidden,
        multi_modal_projector_bias=False,
        norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=INIT_RANGE,
    )
    config = Llama4Config(
        text_config=text,
        vision_config=vision,
        boi_token_index=ids["<|image_start|>"],
        eoi_token_index=ids["<|image_end|>"],
        image_token_index=ids["<|patch|>"],
        tie_word_embeddings=False,
    )
    config.bos_token_id, config.eos_token_id = ids["<|begin_of_text|>"], ids["<|eot|>"]
    config.pad_token_id = ids["<|finetune_right_pad|>"]
    config.initializer_range = INIT_RANGE
    image_processor = Llama4ImageProcessor(
        size={"height": spec.image_size, "width": spec.image_size},
        max_patches=MAX_TILES,
        resize_to_max_canvas=True,
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_convert_rgb=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor = Llama4Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=spec.patch_size,
        pixel_shuffle_ratio=PIXEL_SHUFFLE_RATIO,
        chat_template=LLAMA4_CHAT_TEMPLATE,
    )
    model = Llama4ForConditionalGeneration(config)
    # transformers 5 saves Llama 4 in the hub layout vLLM loads (language_model.model.*, vision_model.*, ...).
    save(model, processor, tokenizer, spec, out)
