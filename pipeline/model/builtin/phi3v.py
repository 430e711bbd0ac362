"""Built-in Phi-3-Vision (`Phi3VForCausalLM`, config `phi3_v`), in the format of Microsoft's
Phi-3-vision-128k-instruct: its config, image processor and processor are checkpoint code
(`configuration_phi3_v.py`, `image_processing_phi3_v.py`, `processing_phi3_v.py`, written here after
Microsoft's, named by the `auto_map`s of config.json and preprocessor_config.json), so it loads only
with `trust_remote_code`; vLLM brings the model (`vllm/model_executor/models/phi3v.py`).

An image is resized (HD transform) to at most `NUM_CROPS` crops of 336 px (its aspect kept, padded
white to whole crops), plus a 336 px global view: each crop's 24×24 CLIP patches are merged 2×2 into
12×12 features, rows ended by a learnt separator (`sub_GN`); sub-crops, then `glb_GN`, then the global
view: `(crops + 1) × 144 + 1 + (crop rows + 1) × 12` tokens. vLLM fixes the tower at CLIP ViT-L/14-336
(1024 wide; not read from the config): the checkpoint keeps it small by taking the features of its
second layer (`layer_idx` -23), so vLLM builds 2 of its 24 layers. The vocabulary is Phi-3's 32064
tokens (vLLM lays images out with token 32044): bytes, padded (common.byte_level_tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.model.builtin.common import (
    CLIP_MEAN_STD,
    INIT_RANGE,
    Spec,
    byte_level_tokenizer,
    chat_template,
    save_code_processor,
)

NUM_CROPS = 4
CROP = 336  # vLLM's CLIP ViT-L/14-336
CLIP_LAYERS = 24
VOCAB_SIZE = 32064  # Phi-3's; vLLM's phi3v.py places images with token id 32044
SPECIAL = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
NL = "{{ '\\n' }}"
# Phi-3's format; images numbered in prompt order, `<|image_1|>`, `<|image_2|>`, ..., which the
# processor (and vLLM's) replaces by the image's tokens.
TEMPLATE = chat_template(
    bos="{% set images = namespace(n=0) %}",
    user_prefix="<|user|>" + NL,
    user_suffix="<|end|>" + NL,
    assistant_prefix="<|assistant|>" + NL,
    assistant_suffix="<|end|>" + NL,
    image="{% set images.n = images.n + 1 %}<|image_{{ images.n }}|>" + NL,
    generation_prompt="<|assistant|>" + NL,
    system_prefix="<|system|>" + NL,
    system_suffix="<|end|>" + NL,
)

CONFIG_CODE = '''"""Phi-3-Vision's config, as in Microsoft's Phi-3-vision-128k-instruct (written by Iris for a tiny
built-in): Phi-3's language-model settings with the image embedding's (`embd_layer`, `img_processor`)."""

from transformers import Phi3Config


class Phi3VConfig(Phi3Config):
    model_type = "phi3_v"

    def __init__(self, embd_layer=None, img_processor=None, **kwargs):
        self.embd_layer = embd_layer if embd_layer is not None else {}
        self.img_processor = img_processor if img_processor is not None else {}
        super().__init__(**kwargs)
'''

IMAGE_PROCESSING_CODE = '''"""Phi-3-Vision's image processor, after Microsoft's image_processing_phi3_v.py (written by
Iris for a tiny built-in): the HD transform to at most `num_crops` crops of 336 px plus a global view."""

import math

import numpy as np
import torch
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature

CROP = 336
OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def calc_hd_transform_size(width, height, hd_num=16):
    """The size an image of `width` x `height` is resized and padded to: whole crops, at most `hd_num`."""
    transposed = width < height
    if transposed:
        width, height = height, width
    ratio = width / height
    scale = 1
    while scale * math.ceil(scale / ratio) <= hd_num:
        scale += 1
    scale -= 1
    new_width = int(scale * CROP)
    new_height = int(new_width / ratio)
    padded_height = int(math.ceil(new_height / CROP) * CROP)
    return (padded_height, new_width) if transposed else (new_width, padded_height)


def hd_transform(image, hd_num=16):
    """Resized (aspect kept) to `scale` crops across the longer side and padded white, centred, to whole crops."""
    width, height = image.size
    transposed = width < height
    if transposed:
        image = image.transpose(Image.TRANSPOSE)
        width, height = image.size
    ratio = width / height
    scale = 1
    while scale * math.ceil(scale / ratio) <= hd_num:
        scale += 1
    scale -= 1
    new_width = int(scale * CROP)
    new_height = int(new_width / ratio)
    image = image.resize((new_width, new_height), Image.BILINEAR)
    target = int(math.ceil(new_height / CROP) * CROP)
    padded = Image.new("RGB", (new_width, target), (255, 255, 255))
    padded.paste(image, (0, (target - new_height) // 2))
    return padded.transpose(Image.TRANSPOSE) if transposed else padded


def num_image_tokens(height, width):
    rows, cols = height // CROP, width // CROP
    return int((rows * cols + 1) * 144 + 1 + (rows + 1) * 12)


class Phi3VImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "image_sizes", "num_img_tokens"]

    def __init__(self, num_crops=1, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD, do_convert_rgb=True,
                 **kwargs):
        super().__init__(**kwargs)
        self.num_crops = num_crops
        self.image_mean = image_mean
        self.image_std = image_std
        self.do_convert_rgb = do_convert_rgb

    def calc_num_image_tokens(self, images):
        if not isinstance(images, list):
            images = [images]
        shapes = [hd_transform(image.convert("RGB"), self.num_crops).size for image in images]
        return [num_image_tokens(h, w) for w, h in shapes]

    def calc_num_image_tokens_from_image_size(self, width, height):
        new_width, new_height = calc_hd_transform_size(width, height, hd_num=self.num_crops)
        return num_image_tokens(new_height, new_width)

    def __call__(self, images, **kwargs):
        return self.preprocess(images, **kwargs)

    def preprocess(self, images, image_mean=None, image_std=None, do_convert_rgb=None, return_tensors=None,
                   **kwargs):
        image_mean = torch.tensor(self.image_mean if image_mean is None else image_mean).view(3, 1, 1)
        image_std = torch.tensor(self.image_std if image_std is None else image_std).view(3, 1, 1)
        if not isinstance(images, (list, tuple)):
            images = [images]
        images = [image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image)) for image in images]
        hd_images = []
        for image in images:
            image = hd_transform(image.convert("RGB"), self.num_crops)
            pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
            hd_images.append((pixels - image_mean) / image_std)
        # The global view: the whole (padded) image at one crop's size.
        global_images = [
            torch.nn.functional.interpolate(im.unsqueeze(0), size=(CROP, CROP), mode="bicubic") for im in hd_images
        ]
        shapes = [[im.size(1), im.size(2)] for im in hd_images]
        num_img_tokens = [num_image_tokens(h, w) for h, w in shapes]
        # (3, h, w) -> (h/336 * w/336, 3, 336, 336), row by row; after the global view; zero-padded
        # to num_crops + 1 crops.
        crops = [
            im.reshape(1, 3, h // CROP, CROP, w // CROP, CROP).permute(0, 2, 4, 1, 3, 5).reshape(-1, 3, CROP, CROP)
            for im, (h, w) in zip(hd_images, shapes)
        ]
        stacked = []
        for global_image, crop in zip(global_images, crops):
            views = torch.cat([global_image, crop], dim=0)
            padding = torch.zeros(self.num_crops + 1 - views.shape[0], 3, CROP, CROP, dtype=views.dtype)
            stacked.append(torch.cat([views, padding], dim=0))
        data = {"pixel_values": torch.stack(stacked), "image_sizes": shapes, "num_img_tokens": num_img_tokens}
        return BatchFeature(data=data, tensor_type=return_tensors)
'''

PROCESSING_CODE = '''"""Phi-3-Vision's processor, after Microsoft's processing_phi3_v.py (written by Iris for a tiny
built-in): `<|image_N|>` in the text becomes image N's `num_img_tokens` tokens, of id -N."""

import re

import torch
from transformers.image_processing_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin

IMAGE_TAG = re.compile(r"<\\|image_\\d+\\|>")


class ImageTags:
    """`<|image_1|>`, `<|image_2|>`, ...: the tags of images in prompt order (indexable, sliceable)."""

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [f"<|image_{i + 1}|>" for i in range(*index.indices(1_000_000))]
        return f"<|image_{index + 1}|>"

    def __len__(self):
        return 1_000_000


class Phi3VProcessor(ProcessorMixin):
    special_image_token = "<|image|>"

    def __init__(self, image_processor, tokenizer, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.img_tokens = ImageTags()
        self.num_img_tokens = getattr(image_processor, "num_img_tokens", None)

    def calc_num_image_tokens(self, images):
        return self.image_processor.calc_num_image_tokens(images)

    def calc_num_image_tokens_from_image_size(self, width, height):
        return self.image_processor.calc_num_image_tokens_from_image_size(width, height)

    def __call__(self, text=None, images=None, return_tensors=None, **kwargs):
        kwargs.pop("truncation", None)
        kwargs.pop("padding", None)
        if images is not None:
            image_inputs = self.image_processor(images, return_tensors=return_tensors)
        else:
            image_inputs = {}
        if text is None:
            return BatchFeature(data=dict(image_inputs), tensor_type=return_tensors)
        if not isinstance(text, str):
            if len(text) != 1:
                raise ValueError("Phi3VProcessor takes one text")
            (text,) = text
        num_img_tokens = list(image_inputs.get("num_img_tokens", []))
        chunks = [self.tokenizer(chunk, add_special_tokens=False).input_ids for chunk in IMAGE_TAG.split(text)]
        image_ids = [int(tag[len("<|image_") : -len("|>")]) for tag in IMAGE_TAG.findall(text)]
        if sorted(set(image_ids)) != list(range(1, len(num_img_tokens) + 1)):
            raise ValueError(f"image tags {image_ids} for {len(num_img_tokens)} images")
        input_ids = list(chunks[0])
        for image_id, chunk in zip(image_ids, chunks[1:]):
            input_ids += [-image_id] * int(num_img_tokens[image_id - 1])
            input_ids += chunk
        input_ids = torch.tensor([input_ids], dtype=torch.long)
        data = {"input_ids": input_ids, "attention_mask": (input_ids > -1000000).long(), **image_inputs}
        return BatchFeature(data=data, tensor_type=return_tensors)

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    @property
    def model_input_names(self):
        return ["input_ids", "attention_mask", "pixel_values", "image_sizes"]
'''


def build(spec: Spec, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, CLIPVisionModel, Phi3Config, Phi3ForCausalLM

    tokenizer = byte_level_tokenizer(SPECIAL, bos=None, eos="<|end|>", pad="<|endoftext|>", vocab_size=spec.vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
    dtype = getattr(torch, spec.dtype)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_mlp(),
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    language_model = Phi3ForCausalLM(Phi3Config(**text)).to(dtype).eval()
    weights = {name: t for name, t in language_model.state_dict().items()}

    # The tower: vLLM's CLIP ViT-L/14-336, its first `spec.vision_layers` layers (the rest are never built).
    clip = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=spec.vision_hidden,
            intermediate_size=spec.vision_mlp(),
            num_hidden_layers=spec.vision_layers,
            num_attention_heads=spec.vision_heads,
            image_size=spec.image_size,
            patch_size=spec.patch_size,
            hidden_act="quick_gelu",
            projection_dim=768,
        )
    ).to(dtype)
    prefix = "model.vision_embed_tokens."
    for name, t in clip.state_dict().items():  # (transformers 5 leaves out the hub layout's `vision_model.`)
        name = name if name.startswith("vision_model.") else "vision_model." + name
        if "post_layernorm" not in name and "position_ids" not in name:  # (vLLM builds no final norm here)
            weights[prefix + "img_processor." + name] = t
    width = 4 * spec.vision_hidden  # 2×2 patches merged into channels
    weights[prefix + "glb_GN"] = torch.randn(1, 1, width).to(dtype)
    weights[prefix + "sub_GN"] = torch.randn(1, 1, 1, width).to(dtype)
    # The projector: Linear(4096, hidden), GELU, Linear(hidden, hidden); a narrower first layer keeps
    # its output near the text embeddings' scale.
    weights[prefix + "img_projection.0.weight"] = (torch.randn(spec.text_hidden, width) * 0.02).to(dtype)
    weights[prefix + "img_projection.0.bias"] = torch.zeros(spec.text_hidden, dtype=dtype)
    weights[prefix + "img_projection.2.weight"] = (torch.randn(spec.text_hidden, spec.text_hidden) * INIT_RANGE).to(
        dtype
    )
    weights[prefix + "img_projection.2.bias"] = torch.zeros(spec.text_hidden, dtype=dtype)
    weights = {n: t.contiguous() for n, t in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = {
        **text,
        "architectures": ["Phi3VForCausalLM"],
        "model_type": "phi3_v",
        "auto_map": {"AutoConfig": "configuration_phi3_v.Phi3VConfig"},
        "embd_layer": {
            "embedding_cls": "image",
            "hd_transform_order": "sub_glb",
            "projection_cls": "mlp",
            "use_hd_transform": True,
            "with_learnable_separator": True,
        },
        "img_processor": {
            "image_dim_out": spec.vision_hidden,
            "model_name": "openai/clip-vit-large-patch14-336",
            "name": "clip_vision_model",
            "num_img_tokens": 144,
            "layer_idx": spec.vision_layers - CLIP_LAYERS - 1,  # the second layer's output: 2 layers built
            "type_feature": "patch",
        },
        "rope_theta": 10000.0,
        "attention_dropout": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "sliding_window": None,
        "use_cache": True,
        "dtype": spec.dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_code_processor(
        out,
        tokenizer,
        TEMPLATE,
        {
            "configuration_phi3_v.py": CONFIG_CODE,
            "image_processing_phi3_v.py": IMAGE_PROCESSING_CODE,
            "processing_phi3_v.py": PROCESSING_CODE,
        },
        "processing_phi3_v.Phi3VProcessor",
        "image_processing_phi3_v.Phi3VImageProcessor",
        num_crops=NUM_CROPS,
        do_convert_rgb=True,
        **CLIP_MEAN_STD,
    )
