"""Built-in Mistral3 (Mistral-Small-3.1 layout, Hugging Face format): Pixtral vision tower,
patch-merging projector, Mistral language model.

Images keep their aspect ratio up to `image_size` on the longest edge and are padded up to
multiples of patch × merge; each merged patch is one [IMG] token, each row ends in
[IMG_BREAK] and the last one in [IMG_END].
"""

from __future__ import annotations

from pathlib import Path

from pipeline.model.builtin.common import (
    CLIP_MEAN_STD,
    INIT_RANGE,
    Spec,
    byte_level_tokenizer,
    chat_template,
    save,
    token_ids,
)

MERGE = 2  # spatial_merge_size: MERGE × MERGE patches -> one token

MISTRAL3_SPECIAL = [
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "[INST]",
    "[/INST]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
]

MISTRAL3_CHAT_TEMPLATE = chat_template(
    user_prefix="[INST]",
    user_suffix="[/INST]",
    assistant_prefix="",
    assistant_suffix="</s>",
    image="[IMG]",
    generation_prompt="",
    system_prefix="[SYSTEM_PROMPT]",
    system_suffix="[/SYSTEM_PROMPT]",
    bos="<s>",
)


def build(spec: Spec, out: Path) -> None:
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralImageProcessor,
        PixtralProcessor,
        PixtralVisionConfig,
    )

    tokenizer = byte_level_tokenizer(MISTRAL3_SPECIAL, bos="<s>", eos="</s>", pad="<pad>")
    ids = token_ids(tokenizer, MISTRAL3_SPECIAL)
    text = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=4 * spec.text_hidden,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        head_dim=spec.text_hidden // spec.text_heads,
        max_position_embeddings=4096,
        sliding_window=None,
        rms_norm_eps=1e-5,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
    )
    vision = PixtralVisionConfig(
        hidden_size=spec.vision_hidden,
        intermediate_size=4 * spec.vision_hidden,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        hidden_act="silu",
        initializer_range=INIT_RANGE,
    )
    config = Mistral3Config(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["[IMG]"],
        spatial_merge_size=MERGE,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        multimodal_projector_bias=False,
        tie_word_embeddings=False,
    )
    config.bos_token_id, config.eos_token_id, config.pad_token_id = ids["<s>"], ids["</s>"], ids["<pad>"]
    config.initializer_range = INIT_RANGE
    image_processor = PixtralImageProcessor(
        size={"longest_edge": spec.image_size},
        patch_size={"height": spec.patch_size, "width": spec.patch_size},
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_convert_rgb=True,
        **CLIP_MEAN_STD,
    )
    processor = PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=spec.patch_size,
        spatial_merge_size=MERGE,
        chat_template=MISTRAL3_CHAT_TEMPLATE,
        image_token="[IMG]",
        image_break_token="[IMG_BREAK]",
        image_end_token="[IMG_END]",
    )
    model = Mistral3ForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)
