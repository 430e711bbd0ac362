"""Built-in PaliGemma: SigLIP tower (all layers, post-norm, no head), linear projector, Gemma
language model. Images are resized to the tower's fixed input size: (side / patch)² tokens
each (16 for the tiny spec), whatever the image's size.

PaliGemma's prompt is `<image>×n <bos> prefix \\n`: vLLM inserts the image tokens and a <bos>
before the prompt itself (its processor, not the text; the prompt carries no image
placeholder) and appends the "\\n". The chat template therefore writes only the text of the
messages: no <bos>, nothing for image parts, no trailing newline. vLLM 0.32 takes one image
per prompt for PaliGemma and attends causally over the prefix where transformers attends
bidirectionally.

The tokenizer is PaliGemma 2's way round (`add_bos_token` false: vLLM puts the image tokens
at the very start); the processor adds PaliGemma's <loc….>/<seg…> tokens to it, as it does
for the real tokenizer. The word embeddings are untied (see gemma3.py)."""

from __future__ import annotations

from pathlib import Path

from pipeline.model.builtin.common import (
    INIT_RANGE,
    Spec,
    byte_level_tokenizer,
    hub_vision_tower_name,
    rename_weights,
    save,
)

TEXT_OF = (
    "{{ message['content'] if message['content'] is string "
    "else message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') }}"
)
# Turns run together as PaliGemma's prefix / suffix pairs: "prefix\nsuffix<eos>prefix...".
PALIGEMMA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '\\n' }}" + TEXT_OF + "<eos>"
    "{% else %}" + TEXT_OF + "{% endif %}{% endfor %}"
)
PALIGEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]


def build(spec: Spec, out: Path) -> None:
    from tokenizers import AddedToken
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )
    from transformers.models.paligemma.processing_paligemma import EXTRA_TOKENS

    # `vocab_size`: the whole vocabulary, "\n" and the processor's <loc>/<seg> tokens included.
    base_vocab = spec.vocab_size - 1 - len(EXTRA_TOKENS) if spec.vocab_size else 0
    tokenizer = byte_level_tokenizer(
        PALIGEMMA_SPECIAL,
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        vocab_size=base_vocab,
        extra_special_tokens={"image_token": "<image>"},
    )
    # vLLM's PaliGemma processor looks "\n" up in the vocabulary (one token in Gemma's) to end
    # the prompt with; byte-level BPE spells it "Ċ", so add it.
    tokenizer.add_tokens([AddedToken("\n", normalized=False, special=False)])
    tokens_per_image = (spec.image_size // spec.patch_size) ** 2
    image_processor = SiglipImageProcessor(
        size={"height": spec.image_size, "width": spec.image_size},
        resample=3,
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_convert_rgb=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    image_processor.image_seq_length = tokens_per_image  # PaliGemmaProcessor reads it
    processor = PaliGemmaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=PALIGEMMA_CHAT_TEMPLATE
    )  # adds the <loc>/<seg> tokens
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in PALIGEMMA_SPECIAL}
    head_dim = spec.text_hidden // spec.text_heads
    text = GemmaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_mlp(),
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        hidden_activation="gelu_pytorch_tanh",
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"],
    )
    vision = SiglipVisionConfig(
        hidden_size=spec.vision_hidden,
        intermediate_size=spec.vision_mlp(),
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        layer_norm_eps=1e-6,
        vision_use_head=False,
        initializer_range=INIT_RANGE,
    )
    config = PaliGemmaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["<image>"],
        vocab_size=len(tokenizer),
        projection_dim=spec.text_hidden,
        hidden_size=spec.text_hidden,
        tie_word_embeddings=False,
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"],
    )
    config.initializer_range = INIT_RANGE
    model = PaliGemmaForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)
    rename_weights(out, hub_vision_tower_name)  # SigLIP: `vision_tower.vision_model.<...>`, as on the hub
