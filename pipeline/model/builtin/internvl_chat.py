"""Built-in InternVL in its original format, as OpenGVLab ships InternVL2.5 / 3 / 3.5
(`InternVLChatModel`, config `internvl_chat`): its config classes are checkpoint code
(`configuration_internvl_chat.py`, `configuration_intern_vit.py`, written here after OpenGVLab's,
named by config.json's `auto_map`), so it loads only with `trust_remote_code`; vLLM brings the
processor (`vllm/model_executor/models/internvl.py`). The same tower, projector and language model
as the Hugging Face format's built-in (InternViT, pixel shuffle v2, Qwen2), in the original's
weight names: a fused `attn.qkv`, `ls1`/`ls2`, `mlp1`."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

from pipeline.model.builtin.common import INIT_RANGE, Spec, byte_level_tokenizer, chat_template

MAX_TILES = 2  # tiles an image is cut into at most (plus a thumbnail when more than one)
DOWNSAMPLE_RATIO = 0.5
# The original's special tokens (InternVL3's tokenizer_config.json); `<|video_pad|>` is the context
# token vLLM lays out video frames with for a Qwen2 language model.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<|video_pad|>"]
NL = "{{ '\\n' }}"
# Items as the original's template writes them: `<image>` / `<video>` text, which vLLM's processor
# replaces by the item's `<img><IMG_CONTEXT>...</img>` tokens.
TEMPLATE = chat_template(
    user_prefix="<|im_start|>user" + NL,
    user_suffix="<|im_end|>" + NL,
    assistant_prefix="<|im_start|>assistant" + NL,
    assistant_suffix="<|im_end|>" + NL,
    image="<image>" + NL,
    generation_prompt="<|im_start|>assistant" + NL,
    system_prefix="<|im_start|>system" + NL,
    system_suffix="<|im_end|>" + NL,
    video="<video>" + NL,
)

VISION_CONFIG_CODE = '''"""InternViT's config, as in OpenGVLab's InternVL checkpoints (written by Iris for a tiny
built-in)."""

from transformers import PretrainedConfig


class InternVisionConfig(PretrainedConfig):
    model_type = "intern_vit_6b"

    def __init__(self, num_channels=3, patch_size=14, image_size=224, qkv_bias=False, hidden_size=3200,
                 num_attention_heads=25, intermediate_size=12800, qk_normalization=True, num_hidden_layers=48,
                 use_flash_attn=False, hidden_act="gelu", norm_type="rms_norm", layer_norm_eps=1e-6, dropout=0.0,
                 drop_path_rate=0.0, attention_dropout=0.0, initializer_range=0.02, initializer_factor=0.1,
                 **kwargs):
        super().__init__(**kwargs)
        self.num_channels = num_channels
        self.patch_size = patch_size
        self.image_size = image_size
        self.qkv_bias = qkv_bias
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.qk_normalization = qk_normalization
        self.num_hidden_layers = num_hidden_layers
        self.use_flash_attn = use_flash_attn
        self.hidden_act = hidden_act
        self.norm_type = norm_type
        self.layer_norm_eps = layer_norm_eps
        self.dropout = dropout
        self.drop_path_rate = drop_path_rate
        self.attention_dropout = attention_dropout
        self.initializer_range = initializer_range
        self.initializer_factor = initializer_factor
'''

CHAT_CONFIG_CODE = '''"""InternVL's chat-model config, as in OpenGVLab's InternVL checkpoints (written by Iris for a
tiny built-in): InternViT's config and the language model's."""

import copy

from transformers import CONFIG_MAPPING, PretrainedConfig

from .configuration_intern_vit import InternVisionConfig


class InternVLChatConfig(PretrainedConfig):
    model_type = "internvl_chat"
    is_composition = True

    def __init__(self, vision_config=None, llm_config=None, use_backbone_lora=0, use_llm_lora=0, select_layer=-1,
                 force_image_size=None, downsample_ratio=0.5, template=None, dynamic_image_size=False,
                 use_thumbnail=False, ps_version="v1", min_dynamic_patch=1, max_dynamic_patch=6, **kwargs):
        super().__init__(**kwargs)
        self.vision_config = InternVisionConfig(**(vision_config or {}))
        llm_config = dict(llm_config or {"model_type": "qwen2"})
        self.llm_config = CONFIG_MAPPING[llm_config.pop("model_type", "qwen2")](**llm_config)
        self.use_backbone_lora = use_backbone_lora
        self.use_llm_lora = use_llm_lora
        self.select_layer = select_layer
        self.force_image_size = force_image_size
        self.downsample_ratio = downsample_ratio
        self.template = template
        self.dynamic_image_size = dynamic_image_size
        self.use_thumbnail = use_thumbnail
        self.ps_version = ps_version
        self.min_dynamic_patch = min_dynamic_patch
        self.max_dynamic_patch = max_dynamic_patch

    def to_dict(self):
        output = copy.deepcopy(self.__dict__)
        for name, value in list(output.items()):
            if isinstance(value, PretrainedConfig):
                output[name] = value.to_dict()
        output["model_type"] = self.__class__.model_type
        return output
'''

# The Hugging Face format's weight names -> the original's (the inverse of transformers'
# convert_internvl_weights_to_hf.py); q/k/v are fused into `attn.qkv` apart.
_RENAMES = [
    (r"^vision_tower\.embeddings\.cls_token$", "vision_model.embeddings.class_embedding"),
    (r"^vision_tower\.embeddings\.patch_embeddings\.projection\.", "vision_model.embeddings.patch_embedding."),
    (r"^vision_tower\.embeddings\.position_embeddings$", "vision_model.embeddings.position_embedding"),
    (
        r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.projection_layer\.",
        r"vision_model.encoder.layers.\1.attn.proj.",
    ),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.lambda_1$", r"vision_model.encoder.layers.\1.ls1"),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.lambda_2$", r"vision_model.encoder.layers.\1.ls2"),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.layernorm_before\.", r"vision_model.encoder.layers.\1.norm1."),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.layernorm_after\.", r"vision_model.encoder.layers.\1.norm2."),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.mlp\.", r"vision_model.encoder.layers.\1.mlp."),
    (r"^multi_modal_projector\.layer_norm\.", "mlp1.0."),
    (r"^multi_modal_projector\.linear_1\.", "mlp1.1."),
    (r"^multi_modal_projector\.linear_2\.", "mlp1.3."),
    (r"^language_model\.", "language_model."),
]
_QKV = re.compile(r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.([qkv])_proj\.(weight|bias)$")


def original_weights(hf_weights: dict) -> dict:
    """The Hugging Face format's tensors under the original format's names."""
    import torch

    out, qkv = {}, {}
    for name, tensor in hf_weights.items():
        if match := _QKV.match(name):
            layer, which, kind = match.groups()
            qkv.setdefault((layer, kind), {})[which] = tensor
            continue
        for pattern, replacement in _RENAMES:
            if re.match(pattern, name):
                out[re.sub(pattern, replacement, name)] = tensor
                break
        else:
            raise ValueError(f"no original-format name for {name}")
    for (layer, kind), parts in qkv.items():
        out[f"vision_model.encoder.layers.{layer}.attn.qkv.{kind}"] = torch.cat([parts[w] for w in "qkv"])
    return out


def build(spec: Spec, out: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    tokenizer = byte_level_tokenizer(SPECIAL, bos=None, eos="<|im_end|>", pad="<|endoftext|>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
    text = dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=4 * spec.text_hidden,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        dtype=spec.dtype,
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
    # The weights: transformers' InternVL (the Hugging Face format of the same model), renamed.
    hf_config = InternVLConfig(
        text_config={k: v for k, v in text.items() if k not in ("architectures", "dtype")},
        vision_config={
            **vision,
            "image_size": [spec.image_size] * 2,
            "patch_size": [spec.patch_size] * 2,
            "attention_bias": True,
            "norm_type": "layer_norm",
            "use_qk_norm": False,
            "use_mean_pooling": True,
            "layer_scale_init_value": 1.0,
        },
        image_token_id=ids["<IMG_CONTEXT>"],
        downsample_ratio=DOWNSAMPLE_RATIO,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    hf_config.initializer_range = INIT_RANGE
    model = InternVLForConditionalGeneration(hf_config)
    import torch

    model = model.to(getattr(torch, spec.dtype)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        weights = {}
        for path in sorted(Path(tmp).glob("*.safetensors")):
            weights.update(load_file(str(path)))
    save_file(
        {n: t.contiguous() for n, t in original_weights(weights).items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )

    config = {
        "architectures": ["InternVLChatModel"],
        "model_type": "internvl_chat",
        "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig"},
        "vision_config": {
            **vision,
            "architectures": ["InternVisionModel"],
            "model_type": "intern_vit_6b",
            "qkv_bias": True,
            "qk_normalization": False,
            "norm_type": "layer_norm",
            "layer_norm_eps": 1e-6,
            "hidden_act": "gelu",
            "initializer_factor": 1.0,
            "use_flash_attn": False,
            "dtype": spec.dtype,
        },
        "llm_config": text,
        "select_layer": -1,
        "force_image_size": spec.image_size,
        "downsample_ratio": DOWNSAMPLE_RATIO,
        "template": "internvl2_5",
        "dynamic_image_size": True,
        "use_thumbnail": True,
        "ps_version": "v2",
        "min_dynamic_patch": 1,
        "max_dynamic_patch": MAX_TILES,
        "tie_word_embeddings": False,
        "dtype": spec.dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "configuration_intern_vit.py").write_text(VISION_CONFIG_CODE)
    (out / "configuration_internvl_chat.py").write_text(CHAT_CONFIG_CODE)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    settings = json.loads((out / "tokenizer_config.json").read_text())
    settings["chat_template"] = TEMPLATE  # (some loaders read it only here)
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    shutil.rmtree(out / "__pycache__", ignore_errors=True)
