"""Built-in SmolVLM: Idefics3's architecture (SigLIP-style tower, pixel-shuffle connector, Llama
language model) with SmolVLM's processor and tokens; vLLM serves it with its Idefics3 classes.

Images are split into tiles of the vision tower's side plus one global view; each tile
becomes `image_seq_len` <image> tokens, framed by <fake_token_around_image> and a
<row_i_col_j> or <global-img> tag (single tokens, as in the hub's tokenizer). The special
tokens and the chat format ("<|im_start|>User:...<end_of_utterance>\\nAssistant:") are SmolVLM's.
SmolVLMProcessor needs the `num2words` package (it spells out video frame counts)."""

from __future__ import annotations

from pathlib import Path

from pipeline.model.builtin.common import (
    INIT_RANGE,
    Spec,
    byte_level_tokenizer,
    chat_template,
    save,
)

SCALE_FACTOR = 2  # pixel shuffle: SCALE_FACTOR² patches -> one token
MAX_TILES_PER_SIDE = 2  # images are resized to at most this many tiles across

SMOLVLM_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    "<video>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]
# SmolVLMProcessor reads these tokenizer attributes (their defaults are the same tokens).
SMOLVLM_TOKEN_ROLES = {
    "fake_image_token": "<fake_token_around_image>",
    "image_token": "<image>",
    "end_of_utterance_token": "<end_of_utterance>",
    "global_image_token": "<global-img>",
    "video_token": "<video>",
}

SMOLVLM_CHAT_TEMPLATE = chat_template(
    user_prefix="User:",
    user_suffix="<end_of_utterance>\n",
    assistant_prefix="Assistant: ",
    assistant_suffix="<end_of_utterance>\n",
    image="<image>",
    generation_prompt="Assistant:",
    system_prefix="System: ",
    system_suffix="<end_of_utterance>\n",
    bos="<|im_start|>",
)


def build(spec: Spec, out: Path) -> None:
    from transformers import (
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )

    tokenizer = byte_level_tokenizer(
        SMOLVLM_SPECIAL,
        bos="<|im_start|>",
        eos="<end_of_utterance>",
        pad="<|im_end|>",
        vocab_size=spec.vocab_size,
        extra_special_tokens=SMOLVLM_TOKEN_ROLES,
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SMOLVLM_SPECIAL}
    text = dict(
        model_type="llama",
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_mlp(),
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<end_of_utterance>"],
        pad_token_id=ids["<|im_end|>"],
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
    )
    vision = dict(
        hidden_size=spec.vision_hidden,
        intermediate_size=spec.vision_mlp(),
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        initializer_range=INIT_RANGE,
    )
    config = SmolVLMConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=ids["<image>"],
        scale_factor=SCALE_FACTOR,
        pad_token_id=ids["<|im_end|>"],
        tie_word_embeddings=False,
    )
    config.bos_token_id, config.eos_token_id = ids["<|im_start|>"], ids["<end_of_utterance>"]
    config.initializer_range = INIT_RANGE
    image_seq_len = (spec.image_size // spec.patch_size) ** 2 // SCALE_FACTOR**2
    mean_std = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    image_processor = SmolVLMImageProcessor(
        size={"longest_edge": MAX_TILES_PER_SIDE * spec.image_size},
        max_image_size={"longest_edge": spec.image_size},
        do_image_splitting=True,
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_pad=True,
        do_convert_rgb=True,
        **mean_std,
    )
    # Frames are one tile each, as in the hub's (size = max_image_size: no splitting).
    video_processor = SmolVLMVideoProcessor(
        size={"longest_edge": spec.image_size},
        max_image_size={"longest_edge": spec.image_size},
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_pad=True,
        do_convert_rgb=True,
        **mean_std,
    )
    processor = SmolVLMProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        image_seq_len=image_seq_len,
        chat_template=SMOLVLM_CHAT_TEMPLATE,
    )
    model = SmolVLMForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)
