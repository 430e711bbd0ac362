"""Built-in Gemma 3: SigLIP tower, average-pool + RMSNorm + linear projector, Gemma 3 language
model. Images are resized to the tower's fixed input size (no pan-and-scan).

Unlike real Gemma 3 the word embeddings are untied: with tied random embeddings greedy decoding
just repeats the last prompt token whatever the image. vLLM 0.32 takes no image embeddings for
Gemma 3, and attends causally over image tokens where transformers attends bidirectionally."""

from __future__ import annotations

from pathlib import Path

from pipeline.model.builtin.common import (
    INIT_RANGE,
    Spec,
    byte_level_tokenizer,
    chat_template,
    hub_vision_tower_name,
    rename_weights,
    save,
)

TOKENS_PER_SIDE = 4

NL = "{{ '\\n' }}"
GEMMA3_CHAT_TEMPLATE = chat_template(
    user_prefix="<start_of_turn>user" + NL,
    user_suffix="<end_of_turn>" + NL,
    assistant_prefix="<start_of_turn>model" + NL,
    assistant_suffix="<end_of_turn>" + NL,
    image="<start_of_image>",
    generation_prompt="<start_of_turn>model" + NL,
    system_prefix="<start_of_turn>system" + NL,
    system_suffix="<end_of_turn>" + NL,
    bos="<bos>",
)

GEMMA3_SPECIAL = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
# Gemma3Processor reads these tokenizer attributes (as Gemma 3's tokenizer_config.json sets them).
GEMMA3_TOKEN_ROLES = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}


def build(spec: Spec, out: Path) -> None:
    import torch
    from tokenizers import AddedToken
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
    )

    tokenizer = byte_level_tokenizer(
        GEMMA3_SPECIAL, bos="<bos>", eos="<end_of_turn>", pad="<pad>", extra_special_tokens=GEMMA3_TOKEN_ROLES
    )
    # vLLM's Gemma 3 processor looks up "\n" .. "\n\n\n\n" in the vocabulary (single tokens in
    # Gemma's, merged around the image sequence); byte-level BPE spells "\n" as "Ċ", so add them.
    tokenizer.add_tokens([AddedToken("\n" * n, normalized=False, special=False) for n in range(1, 5)])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA3_SPECIAL}
    head_dim = spec.text_hidden // spec.text_heads
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=4 * spec.text_hidden,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        max_position_embeddings=4096,
        sliding_window=512,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<end_of_turn>"],
        pad_token_id=ids["<pad>"],
    )
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=spec.vision_hidden,
        intermediate_size=4 * spec.vision_hidden,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        layer_norm_eps=1e-6,
        vision_use_head=False,
        initializer_range=INIT_RANGE,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_SIDE**2,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<end_of_turn>"],
        pad_token_id=ids["<pad>"],
    )
    image_processor = Gemma3ImageProcessor(
        size={"height": spec.image_size, "width": spec.image_size},
        resample=2,
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_convert_rgb=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        do_pan_and_scan=False,
    )
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=TOKENS_PER_SIDE**2,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )
    model = Gemma3ForConditionalGeneration(config)
    # transformers zero-initialises the projection, which would make every image embed to zeros.
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=INIT_RANGE)
    save(model, processor, tokenizer, spec, out)
    rename_weights(out, hub_vision_tower_name)
