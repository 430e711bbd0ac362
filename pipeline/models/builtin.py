"""Built-in random-weight VLM checkpoints, made locally (no model hub).

    python -m pipeline.models.builtin --family llava|qwen2_vl|qwen2_5_vl --size tiny|bench --out DIR

writes a Hugging Face hub-layout checkpoint (config, safetensors weights, a
byte-level BPE tokenizer, image processor, processor, chat template) that both
transformers and vLLM load. Weights are seeded, so the same arguments always
give the same checkpoint.

- `tiny`: hidden size 128, 2 layers, small images; for tests.
- `bench`: a realistically sized vision tower (CLIP ViT-B/16 at 224 px for
  LLaVA, a ViT-B-sized tower at 224 px for Qwen2-VL and Qwen2.5-VL) in front of a small
  language model, so vision work dominates time as in real deployments.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

FAMILIES = ("llava", "qwen2_vl", "qwen2_5_vl")
SIZES = ("tiny", "bench")

# Bump when the builder's output changes, so cached built-in checkpoints are rebuilt.
BUILDER_VERSION = 1

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
    "{{ message['content'] if message['content'] is string else message['content'] | map(attribute='text') | join('') }}"
    "</s>{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}{{ '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)

LLAVA_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
QWEN2_VL_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
]


@dataclass(frozen=True)
class Spec:
    """Sizes of one built-in checkpoint."""

    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    image_size: int  # LLaVA: the CLIP input size; Qwen2-VL: the side of max_pixels
    patch_size: int
    dtype: str


SPECS = {
    ("llava", "tiny"): Spec(128, 2, 4, 2, 64, 2, 4, 56, 14, "float32"),
    ("llava", "bench"): Spec(256, 2, 4, 2, 768, 12, 12, 224, 16, "bfloat16"),
    ("qwen2_vl", "tiny"): Spec(128, 2, 4, 2, 64, 2, 4, 112, 14, "float32"),
    ("qwen2_vl", "bench"): Spec(256, 2, 4, 2, 768, 12, 12, 224, 14, "bfloat16"),
    ("qwen2_5_vl", "tiny"): Spec(128, 2, 4, 2, 64, 2, 4, 112, 14, "float32"),
    ("qwen2_5_vl", "bench"): Spec(256, 2, 4, 2, 768, 12, 12, 224, 14, "bfloat16"),
}

# Random weights drawn with the usual 0.02 std give near-uniform logits, so greedy
# output barely depends on the image; a wider init makes tests sensitive to it.
INIT_RANGE = 0.2
SEED = 1234


def _byte_level_tokenizer(special_tokens: list[str], bos: str | None, eos: str, pad: str):
    """A byte-level BPE tokenizer with the 256 byte symbols and no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special_tokens)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
        unk_token="<unk>" if "<unk>" in special_tokens else None,
    )


def _build_llava(spec: Spec):
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tokenizer = _byte_level_tokenizer(LLAVA_SPECIAL, bos="<s>", eos="</s>", pad="<pad>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in LLAVA_SPECIAL}
    vocab_size = len(tokenizer)
    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden, intermediate_size=4 * spec.vision_hidden,
        num_hidden_layers=spec.vision_layers, num_attention_heads=spec.vision_heads,
        image_size=spec.image_size, patch_size=spec.patch_size, projection_dim=spec.vision_hidden,
        initializer_range=INIT_RANGE,
    )
    text = LlamaConfig(
        vocab_size=vocab_size, hidden_size=spec.text_hidden, intermediate_size=4 * spec.text_hidden,
        num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads, max_position_embeddings=4096,
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
        initializer_range=INIT_RANGE, tie_word_embeddings=False,
    )
    num_patches = (spec.image_size // spec.patch_size) ** 2
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=ids["<image>"],
        projector_hidden_act="gelu", vision_feature_layer=-2,
        vision_feature_select_strategy="default", image_seq_length=num_patches,
        pad_token_id=ids["<pad>"], bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
    )
    config.initializer_range = INIT_RANGE
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": spec.image_size},
        crop_size={"height": spec.image_size, "width": spec.image_size},
        do_center_crop=True, do_resize=True, do_normalize=True, do_convert_rgb=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=spec.patch_size,
        vision_feature_select_strategy="default", chat_template=LLAVA_CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )
    model = LlavaForConditionalGeneration(config)
    return model, processor, tokenizer


def _build_qwen2_vl(spec: Spec, v2_5: bool = False):
    """Qwen2-VL, or with `v2_5` Qwen2.5-VL (windowed-attention ViT with RMSNorm and SwiGLU)."""
    import transformers
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    prefix = "Qwen2_5_VL" if v2_5 else "Qwen2VL"
    config_cls, model_cls, processor_cls = (getattr(transformers, prefix + name) for name in
                                            ("Config", "ForConditionalGeneration", "Processor"))

    tokenizer = _byte_level_tokenizer(QWEN2_VL_SPECIAL, bos=None, eos="<|im_end|>", pad="<|endoftext|>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_SPECIAL}
    head_dim = spec.text_hidden // spec.text_heads
    half = head_dim // 2
    mrope_section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # t, h, w: sums to head_dim/2
    text = dict(
        vocab_size=len(tokenizer), hidden_size=spec.text_hidden, intermediate_size=4 * spec.text_hidden,
        num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads, max_position_embeddings=4096,
        rope_scaling={"type": "mrope", "mrope_section": mrope_section}, rope_theta=1000000.0,
        initializer_range=INIT_RANGE, tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )
    if v2_5:
        vision = dict(
            depth=spec.vision_layers, hidden_size=spec.vision_hidden, out_hidden_size=spec.text_hidden,
            intermediate_size=4 * spec.vision_hidden, num_heads=spec.vision_heads, hidden_act="silu",
            patch_size=spec.patch_size, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
            window_size=2 * 2 * spec.patch_size * 2, fullatt_block_indexes=[spec.vision_layers - 1],
            tokens_per_second=2, initializer_range=INIT_RANGE,
        )
    else:
        vision = dict(
            depth=spec.vision_layers, embed_dim=spec.vision_hidden, hidden_size=spec.text_hidden,
            num_heads=spec.vision_heads, mlp_ratio=4, patch_size=spec.patch_size,
            spatial_merge_size=2, temporal_patch_size=2, in_channels=3, in_chans=3,
            initializer_range=INIT_RANGE,
        )
    config = config_cls(
        text_config=text, vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    config.initializer_range = INIT_RANGE
    unit = spec.patch_size * 2  # one merged visual token covers unit×unit pixels
    image_processor = Qwen2VLImageProcessor(
        min_pixels=unit * unit * 4, max_pixels=spec.image_size * spec.image_size,
        patch_size=spec.patch_size, merge_size=2, temporal_patch_size=2,
    )
    video_processor = Qwen2VLVideoProcessor(patch_size=spec.patch_size, merge_size=2, temporal_patch_size=2)
    processor = processor_cls(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )
    model = model_cls(config)
    return model, processor, tokenizer


def _rewrite_llava_vision_keys(out: Path) -> None:
    """transformers 5 saves `vision_tower.<...>`; vLLM expects the hub layout
    `vision_tower.vision_model.<...>` (as in llava-hf checkpoints)."""
    from safetensors.torch import load_file, save_file

    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(path))
        renamed = {}
        for name, t in tensors.items():
            for prefix in ("model.vision_tower.", "vision_tower."):
                if name.startswith(prefix) and not name.startswith(prefix + "vision_model."):
                    name = prefix + "vision_model." + name[len(prefix):]
                    break
            renamed[name] = t.contiguous()
        save_file(renamed, str(path), metadata={"format": "pt"})


def build_checkpoint(family: str, size: str, out: str | os.PathLike) -> Path:
    """Write the built-in checkpoint `family`/`size` to `out` and return its path."""
    import torch

    if (family, size) not in SPECS:
        raise ValueError(f"unknown built-in checkpoint {family}/{size}; families {FAMILIES}, sizes {SIZES}")
    spec = SPECS[(family, size)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    if family == "llava":
        model, processor, tokenizer = _build_llava(spec)
    else:
        model, processor, tokenizer = _build_qwen2_vl(spec, v2_5=family == "qwen2_5_vl")
    dtype = getattr(torch, spec.dtype)
    model = model.to(dtype).eval()
    model.config.dtype = spec.dtype
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if family == "llava":
        _rewrite_llava_vision_keys(out)
    # The template also lives in tokenizer_config.json: some loaders read it only there.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = processor.chat_template
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (out / "iris_builtin.json").write_text(json.dumps(
        {"family": family, "size": size, "builder_version": BUILDER_VERSION, "seed": SEED}, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args()
    path = build_checkpoint(args.family, args.size, args.out)
    print(path)


if __name__ == "__main__":
    main()
