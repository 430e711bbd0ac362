"""Built-in LLaVA-1.5: CLIP vision tower, MLP projector, Llama language model."""

from __future__ import annotations

from pathlib import Path

from pipeline.model.builtin.common import (
    CLIP_MEAN_STD,
    INIT_RANGE,
    Spec,
    byte_level_tokenizer,
    hub_vision_tower_name,
    rename_weights,
    save,
)

LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] if message['content'] is string "
    "else message['content'] | map(attribute='text') | join('') }}{{ '\\n' }}"
    "{% elif message['role'] == 'user' %}USER: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{{ '\\n' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}"
    "{% else %}ASSISTANT: "
    "{{ message['content'] if message['content'] is string "
    "else message['content'] | map(attribute='text') | join('') }}"
    "</s>{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

LLAVA_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]


def clip_llama(spec: Spec):
    """The tokenizer, its special ids, and the CLIP tower's and Llama's configs of the LLaVA family."""
    from transformers import CLIPVisionConfig, LlamaConfig

    tokenizer = byte_level_tokenizer(LLAVA_SPECIAL, bos="<s>", eos="</s>", pad="<pad>", vocab_size=spec.vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in LLAVA_SPECIAL}
    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden,
        intermediate_size=spec.vision_mlp(),
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        projection_dim=spec.vision_hidden,
        initializer_range=INIT_RANGE,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_mlp(),
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=4096,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
    )
    return tokenizer, ids, vision, text


def llava_processor(processor_class, image_processor, tokenizer, spec: Spec):
    return processor_class(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=spec.patch_size,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )


def build(spec: Spec, out: Path) -> None:
    from transformers import (
        CLIPImageProcessor,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer, ids, vision, text = clip_llama(spec)
    num_patches = (spec.image_size // spec.patch_size) ** 2
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["<image>"],
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=num_patches,
        pad_token_id=ids["<pad>"],
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
    )
    config.initializer_range = INIT_RANGE
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": spec.image_size},
        crop_size={"height": spec.image_size, "width": spec.image_size},
        do_center_crop=True,
        do_resize=True,
        do_normalize=True,
        do_convert_rgb=True,
        **CLIP_MEAN_STD,
    )
    processor = llava_processor(LlavaProcessor, image_processor, tokenizer, spec)
    model = LlavaForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)
    rename_weights(out, hub_vision_tower_name)
