"""What every built-in checkpoint builder shares: sizes, seeds, the tokenizer, saving."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Random weights drawn with the usual 0.02 std give near-uniform logits, so greedy
# output barely depends on the image; a wider init makes tests sensitive to it.
INIT_RANGE = 0.2
SEED = 1234
# OpenAI CLIP's normalisation, which LLaVA-family image processors use.
CLIP_MEAN_STD = dict(image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])


@dataclass(frozen=True)
class Spec:
    """Sizes of one built-in checkpoint. vLLM's CPU attention takes head sizes
    32, 64, 80, 96, 112, 128, ... only: keep hidden / heads at one of them."""

    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    image_size: int  # fixed-size towers: the input side; dynamic resolution: the side of max_pixels
    patch_size: int
    dtype: str
    # Real-size checkpoints (families that read them: LLaVA, Qwen2-VL, Qwen2.5-VL); 0 / () is the default:
    text_intermediate: int = 0  # the language model's MLP width; 0: 4 × text_hidden
    vision_intermediate: int = 0  # the tower's MLP width; 0: 4 × vision_hidden
    vocab_size: int = 0  # 0: the byte-level tokenizer's own (~260); more: padded to it (byte_level_tokenizer)
    vision_full_attention: tuple[int, ...] = ()  # Qwen2.5-VL's full-attention blocks; (): the last one
    # Draw the weights in `dtype` on a GPU where there is one (else on the CPU) instead of in float32
    # on the CPU: a 7B model in minutes rather than most of an hour. Other weights than a CPU build's.
    fast_build: bool = False

    def text_mlp(self) -> int:
        return self.text_intermediate or 4 * self.text_hidden

    def vision_mlp(self) -> int:
        return self.vision_intermediate or 4 * self.vision_hidden


def byte_level_tokenizer(special_tokens: list[str], bos: str | None, eos: str, pad: str, vocab_size: int = 0, **extra):
    """A byte-level BPE tokenizer with the 256 byte symbols and no merges. With `vocab_size`, padded
    to that many tokens (special ones included) with 3-symbol tokens that no text encodes to (there
    are no merges) but that decode to bytes like any other: a language model of a real model's
    vocabulary (embedding and output layer at their real sizes) whose every output decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    padding = vocab_size - len(vocab) - len(special_tokens) if vocab_size else 0
    if padding < 0 or padding >= 256**3:
        raise ValueError(f"vocab_size {vocab_size}: not between {len(vocab) + len(special_tokens)} and 256³")
    for i in range(padding):
        vocab[alphabet[i % 256] + alphabet[i // 256 % 256] + alphabet[i // 65536]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special_tokens)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token="<unk>" if "<unk>" in special_tokens else None,
        **extra,
    )


def token_ids(tokenizer, tokens: list[str]) -> dict[str, int]:
    return {t: tokenizer.convert_tokens_to_ids(t) for t in tokens}


def qwen_vision_token_ids(ids: dict[str, int]) -> dict[str, int]:
    """The special-token ids of a Qwen-VL config (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )


def chat_template(
    user_prefix: str,
    user_suffix: str,
    assistant_prefix: str,
    assistant_suffix: str,
    image: str,
    generation_prompt: str,
    system_prefix: str = "",
    system_suffix: str = "\n",
    bos: str = "",
    video: str | None = None,
) -> str:
    """A Jinja chat template: text and image parts (and video parts, given `video`) of user
    messages, string or list content."""
    text_of = (
        "{{ message['content'] if message['content'] is string "
        "else message['content'] | map(attribute='text') | join('') }}"
    )
    return (
        bos + "{% for message in messages %}"
        "{% if message['role'] == 'system' %}"
        + system_prefix
        + text_of
        + system_suffix
        + "{% elif message['role'] == 'user' %}"
        + user_prefix
        + "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}"
        + image
        + ("{% elif part['type'] == 'video' %}" + video if video is not None else "")
        + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        + user_suffix
        + "{% else %}"
        + assistant_prefix
        + text_of
        + assistant_suffix
        + "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}" + generation_prompt + "{% endif %}"
    )


def save(model, processor, tokenizer, spec: Spec, out: Path) -> None:
    """Save in hub layout; the chat template also goes into tokenizer_config.json
    (some loaders read it only there)."""
    import torch

    model = model.to(getattr(torch, spec.dtype)).eval()
    model.config.dtype = spec.dtype
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = processor.chat_template
    cfg_path.write_text(json.dumps(cfg, indent=2))


def save_code_processor(
    out: Path, tokenizer, template: str, code: dict[str, str], processor: str, image_processor: str, **image_settings
) -> None:
    """The processor half of a checkpoint whose processor is checkpoint code (Phi-3-Vision's,
    MiniCPM-V's original format): the `code` files (name -> source), preprocessor_config.json and
    processor_config.json naming the code's `processor` and `image_processor` (module.Class), the
    image processor's settings, the chat template beside the tokenizer and in its config (some
    loaders read it only there); no `__pycache__` of the code is left behind."""
    import shutil

    for name, source in code.items():
        (out / name).write_text(source)
    auto_map = {"AutoProcessor": processor, "AutoImageProcessor": image_processor}
    processor_class = processor.rsplit(".", 1)[1]
    preprocessor = {
        "auto_map": auto_map,
        "image_processor_type": image_processor.rsplit(".", 1)[1],
        "processor_class": processor_class,
        **image_settings,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    named = {"AutoProcessor": processor}
    (out / "processor_config.json").write_text(json.dumps({"auto_map": named, "processor_class": processor_class}))
    (out / "chat_template.jinja").write_text(template)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    settings = json.loads((out / "tokenizer_config.json").read_text())
    settings.update(chat_template=template, processor_class=processor_class, auto_map=named)
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    shutil.rmtree(out / "__pycache__", ignore_errors=True)


def rename_weights(out: Path, rename) -> None:
    """Rewrite the saved weight names with `rename(name) -> name` (transformers 5 saves
    some families in a layout other than the hub's, which vLLM's loaders expect)."""
    from safetensors.torch import load_file, save_file

    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(path))
        save_file({rename(n): t.contiguous() for n, t in tensors.items()}, str(path), metadata={"format": "pt"})


def hub_vision_tower_name(name: str) -> str:
    """CLIP towers: transformers 5 saves `vision_tower.<...>`; vLLM expects the hub layout
    `vision_tower.vision_model.<...>` (as in llava-hf checkpoints)."""
    for prefix in ("model.vision_tower.", "vision_tower."):
        if name.startswith(prefix) and not name.startswith(prefix + "vision_model."):
            return prefix + "vision_model." + name[len(prefix) :]
    return name
