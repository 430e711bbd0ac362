"""Built-in Idefics3: SigLIP-style vision tower, pixel-shuffle connector, Llama language model.

Images are split into tiles of the vision tower's side plus one global view; each tile
becomes `image_seq_len` <image> tokens, framed by <fake_token_around_image> and a
<row_i_col_j> or <global-img> tag (added to the tokenizer as single tokens, as in the hub's).
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

SCALE_FACTOR = 2  # pixel shuffle: SCALE_FACTOR² patches -> one token
MAX_TILES_PER_SIDE = 2  # images are resized to at most this many tiles across

IDEFICS3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<pad>",
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]

IDEFICS3_CHAT_TEMPLATE = chat_template(
    user_prefix="User:",
    user_suffix="<end_of_utterance>\n",
    assistant_prefix="Assistant: ",
    assistant_suffix="<end_of_utterance>\n",
    image="<image>",
    generation_prompt="Assistant:",
    system_prefix="System: ",
    system_suffix="<end_of_utterance>\n",
    bos="<|begin_of_text|>",
)


def build(spec: Spec, out: Path) -> None:
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        LlamaConfig,
    )

    tokenizer = byte_level_tokenizer(IDEFICS3_SPECIAL, bos="<|begin_of_text|>", eos="<end_of_utterance>", pad="<pad>")
    ids = token_ids(tokenizer, IDEFICS3_SPECIAL)
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=4 * spec.text_hidden,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=ids["<end_of_utterance>"],
        pad_token_id=ids["<pad>"],
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
    )
    vision = dict(
        hidden_size=spec.vision_hidden,
        intermediate_size=4 * spec.vision_hidden,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        initializer_range=INIT_RANGE,
    )
    config = Idefics3Config(
        vision_config=vision,
        text_config=text,
        image_token_id=ids["<image>"],
        scale_factor=SCALE_FACTOR,
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
    )
    config.bos_token_id, config.eos_token_id = ids["<|begin_of_text|>"], ids["<end_of_utterance>"]
    config.initializer_range = INIT_RANGE
    image_seq_len = (spec.image_size // spec.patch_size) ** 2 // SCALE_FACTOR**2
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": MAX_TILES_PER_SIDE * spec.image_size},
        max_image_size={"longest_edge": spec.image_size},
        do_image_splitting=True,
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_pad=True,
        do_convert_rgb=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=image_seq_len,
        chat_template=IDEFICS3_CHAT_TEMPLATE,
    )
    model = Idefics3ForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)
